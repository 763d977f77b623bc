"""The KV-capacity count: the block manager fills the cache; groups hold more of long sequences."""

from kvserve.benchmarks.instruments.kv_capacity import cache_blocks, fill, layer_windows, main


def test_groups_hold_more_long_sequences_and_as_many_short_ones():
    groups, full = layer_windows(12, 64, 6), layer_windows(12, None, 6)
    assert groups.count(None) == 2 and full == [None] * 12
    budget = 4 << 20
    blocks = {name: cache_blocks(w, budget, 16, 1, 64, 2) for name, w in (("g", groups), ("f", full))}
    assert blocks == {"g": budget // (2 * 2 * 16 * 64 * 2), "f": budget // (2 * 12 * 16 * 64 * 2)}
    long_g, long_f = fill(groups, blocks["g"], 16, 2048, 256), fill(full, blocks["f"], 16, 2048, 256)
    assert long_f == blocks["f"] // 128 and long_g > 3 * long_f
    assert fill(groups, blocks["g"], 16, 48, 256) == fill(full, blocks["f"], 16, 48, 256)  # under the window


def test_the_command_prints_its_table(capsys):
    main(["--layers", "6", "--head-dim", "64", "--window", "32", "--kv-cache-memory", "0.002",
          "--lengths", "256", "512"])
    out = capsys.readouterr().out
    assert "| 256 |" in out and "| 512 |" in out and "x |" in out
