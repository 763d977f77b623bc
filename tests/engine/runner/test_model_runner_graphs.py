"""ModelRunner's decode-graph wiring and its attention backend choice.

A tiny random Llama runs on the Triton backend (compiled on a GPU, under Triton's interpreter on
the CPU) twice: with decode graphs, captured by a recorder whose replay re-runs the captured
body on the same static buffers (what a CUDA graph does), and with ``enforce_eager``. The graph
path must give the eager logits for every real row, whatever the padding to its captured size.
On a GPU, a whole engine with real CUDA graphs must generate the greedy tokens of an eager one.
"""

import sys
import types

import pytest
import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.attention.backend import create_attention_backend, resolve_backend_name
from kvserve.engine.model_input import ModelInput
from kvserve.engine.runner.cuda_graphs import decode_graphs_enabled
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.testing.graph_recorder import BLOCK, MAX_NUM_SEQS, Recorder, Seq, step, triton_runner_config

pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

CUDA = torch.cuda.is_available()
PROMPT_LENS = (7, 18, 3, 33, 12)  # five sequences: one more than the largest captured size


def runner_config(model_dir, **changes) -> EngineConfig:
    return triton_runner_config(model_dir, 24, **changes)


@pytest.fixture(scope="module")
def runners(model_dir):
    """(graphed, eager) runners over the same weights, each with every PROMPT_LENS prompt prefilled
    (eagerly: a prefill never replays a graph). No sequence uses block 0, where padding points."""
    graphed = ModelRunner(runner_config(model_dir), record_graph=Recorder())
    eager = ModelRunner(runner_config(model_dir, enforce_eager=True), record_graph=Recorder())
    seqs = [Seq(i, n) for i, n in enumerate(PROMPT_LENS)]
    prefill = step(seqs, [s.prompt for s in seqs])
    for runner in (graphed, eager):
        runner.execute_model(prefill)
    yield graphed, eager, seqs
    graphed.shutdown()
    eager.shutdown()


def replays(runner: ModelRunner) -> dict[int, int]:
    return {size: graph.replays for size, graph in runner.graphs.graphs.items()}


def run_both(graphed: ModelRunner, eager: ModelRunner, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
    ours, theirs = graphed.execute_model(inp), eager.execute_model(inp)
    assert ours.shape == theirs.shape == (len(inp.logits_indices), 10240)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    return ours, theirs


def test_graphs_are_captured_for_the_ladder_and_only_without_enforce_eager(runners):
    graphed, eager, _ = runners
    assert graphed.graphs.captured == [1, 2, 4]
    assert graphed.graphs.static.block_tables.shape == (4, 64 // BLOCK)  # as wide as max_model_len needs
    assert eager.graphs is None


def test_decode_replays_the_smallest_graph_that_holds_it_with_the_eager_logits(runners):
    graphed, eager, seqs = runners
    before = replays(graphed)
    run_both(graphed, eager, step(seqs[:3], [[11], [12], [13]]))  # 3 rows, padded to 4
    assert replays(graphed) == {**before, 4: before[4] + 1}
    run_both(graphed, eager, step(seqs[3:4], [[14]]))  # 1 row, no padding
    assert replays(graphed) == {**before, 4: before[4] + 1, 1: before[1] + 1}
    # padded rows wrote no K/V: block 0, where their tables point, is still all zeros
    assert not graphed.kv_cache[:, :, 0].any()
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-5, rtol=1e-5)


def with_rows(inp: ModelInput, writer, seq_ids: list[int]) -> ModelInput:
    """The step as the engine sends it: rows in the runners' block table plus the new blocks."""
    for seq_id, table in zip(seq_ids, inp.block_tables, strict=True):
        row, update = writer.place(seq_id, table)
        inp.seq_rows.append(row)
        inp.table_updates += [update] if update else []
    return inp


def test_graph_replay_takes_block_tables_from_the_runners_persistent_array(runners):
    from kvserve.engine.model_input import BlockTableWriter

    graphed, eager, seqs = runners
    writer = BlockTableWriter(MAX_NUM_SEQS, 64 // BLOCK)
    before = sum(replays(graphed).values())
    for token in (51, 52):  # the second step sends rows only: every block is already there
        plain = step(seqs[1:4], [[token], [token], [token]])
        sent = with_rows(step_copy(plain), writer, [1, 2, 3])
        assert bool(sent.table_updates) == (token == 51)
        ours, theirs = graphed.execute_model(sent), eager.execute_model(plain)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        assert sent.block_table_array.tolist() == [t + [0] * (3 - len(t)) for t in plain.block_tables]
    assert sum(replays(graphed).values()) == before + 2


def step_copy(inp: ModelInput) -> ModelInput:
    names = ("input_ids", "positions", "query_lens", "context_lens", "block_tables", "slot_mapping",
             "logits_indices")
    return ModelInput(**{name: list(getattr(inp, name)) for name in names})


def test_graph_path_returns_logits_only_for_the_rows_asked(runners):
    graphed, eager, seqs = runners
    before = sum(replays(graphed).values())
    ours, _ = run_both(graphed, eager, step(seqs[:2], [[21], [22]], logits_for=[False, True]))
    assert ours.shape[0] == 1 and sum(replays(graphed).values()) == before + 1


def test_batches_above_the_largest_graph_and_prefill_steps_run_eagerly(runners):
    graphed, eager, seqs = runners
    before = replays(graphed)
    run_both(graphed, eager, step(seqs, [[31], [32], [33], [34], [35]]))  # 5 > 4
    run_both(graphed, eager, step(seqs[:2], [[41, 42], [43]]))  # a two-token chunk: not decode-only
    assert replays(graphed) == before


def test_greedy_decode_through_graphs_follows_the_eager_tokens(runners):
    graphed, eager, seqs = runners
    tokens = {"graphed": [[5], [6]], "eager": [[5], [6]]}
    for _ in range(3):
        inp = step(seqs[3:], tokens["graphed"])
        for name, runner in (("graphed", graphed), ("eager", eager)):
            tokens[name] = [[t] for t in runner.execute_model(inp).argmax(-1).tolist()]
        assert tokens["graphed"] == tokens["eager"]


def test_torch_backend_and_enforce_eager_turn_decode_graphs_off(model_dir):
    recorder = Recorder()
    runner = ModelRunner(runner_config(model_dir, attention_backend="torch"), record_graph=recorder)
    assert runner.graphs is None and recorder.graphs == []  # the torch backend plans steps on the host
    runner.shutdown()
    cuda = torch.device("cuda")
    assert decode_graphs_enabled(False, "triton", cuda) and decode_graphs_enabled(False, "flash-attn", cuda)
    assert not decode_graphs_enabled(True, "triton", cuda)
    assert not decode_graphs_enabled(False, "torch", cuda)
    assert not decode_graphs_enabled(False, "triton", torch.device("cpu"))


def test_shutdown_releases_the_graphs(model_dir):
    runner = ModelRunner(runner_config(model_dir, max_num_seqs=1), record_graph=Recorder())
    graphs = runner.graphs
    assert graphs.captured == [1]
    runner.shutdown()
    assert runner.graphs is None and graphs.graphs == {} and graphs.hidden is None


def test_a_runner_built_directly_follows_the_engines_max_model_len_rule(model_dir):
    from types import SimpleNamespace

    from kvserve.engine.config import resolve_max_model_len

    qwen3_0_6b = SimpleNamespace(max_position_embeddings=40960)
    assert resolve_max_model_len(EngineConfig(), qwen3_0_6b) == 8192  # capped when not given
    assert resolve_max_model_len(EngineConfig(max_model_len=20000), qwen3_0_6b) == 20000
    with pytest.raises(ValueError, match=r"\(50000\) exceeds .*max_position_embeddings \(40960\)"):
        resolve_max_model_len(EngineConfig(max_model_len=50000), qwen3_0_6b)
    config = runner_config(model_dir, max_model_len=None, max_num_seqs=1)
    runner = ModelRunner(config, record_graph=Recorder())
    assert runner.max_model_len == 2048  # the tiny model's own limit, below the cap
    assert runner.graphs.static.block_tables.shape == (1, 2048 // BLOCK)
    runner.shutdown()


def test_the_warm_up_sampler_pass_runs_every_stage_over_max_num_seqs_rows(model_dir):
    from kvserve.engine.runner.model_runner import WARM_UP_SAMPLING

    WARM_UP_SAMPLING.validate(10240)
    assert WARM_UP_SAMPLING.top_p < 1 and WARM_UP_SAMPLING.top_k > 0 and WARM_UP_SAMPLING.logprobs > 0
    runner = ModelRunner(runner_config(model_dir, max_num_seqs=6, enforce_eager=True))
    runner.sample_full_batch()  # on CUDA this runs inside the measured warm-up
    runner.shutdown()


@pytest.mark.skipif(not CUDA, reason="GPU memory sizing needs a GPU")
def test_kv_sizing_leaves_room_for_graphs_sampler_and_the_largest_step(model_dir):
    """Sized for a utilization 2 GiB above what is in use now, a runner with graphs, after a
    full-size sampler pass and the largest prefill, stays under that line."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(0.95, (total - free + 2 * 2**30) / total)
    runner = ModelRunner(runner_config(model_dir, num_kv_blocks=None, max_num_seqs=64, max_model_len=2048,
                                       max_num_batched_tokens=4096, gpu_memory_utilization=utilization))
    assert runner.graphs.captured[-1] == 64
    runner.sample_full_batch()
    runner.execute_model(runner._warm_up_input())
    torch.cuda.synchronize()
    in_use = total - torch.cuda.mem_get_info()[0]
    runner.shutdown()
    assert in_use <= utilization * total + 64 * 2**20, (in_use, utilization * total)


# ---------------------------------------------------------------- which attention backend runs


@pytest.fixture
def importable_flash_attn(monkeypatch):
    """A stand-in ``flash_attn`` module, so that the flash-attn backend imports."""
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake.flash_attn_with_kvcache = None
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    yield
    sys.modules.pop("kvserve.engine.layers.attention.flash_backend", None)  # imported against the stand-in


def test_auto_picks_flash_attn_only_for_block_sizes_it_pages(importable_flash_attn):
    cuda = torch.device("cuda")
    assert resolve_backend_name("auto", cuda, 256, torch.bfloat16) == "flash-attn"
    assert resolve_backend_name("auto", cuda, 512, torch.float16) == "flash-attn"
    assert resolve_backend_name("auto", cuda, 16, torch.bfloat16) == "triton"
    assert resolve_backend_name("auto", torch.device("cpu"), 256, torch.bfloat16) == "torch"


def test_auto_never_picks_flash_attn_for_float32(importable_flash_attn):
    assert resolve_backend_name("auto", torch.device("cuda"), 256, torch.float32) == "triton"


def test_explicit_flash_attn_in_float32_names_dtype_and_why(importable_flash_attn):
    with pytest.raises(ValueError, match=r"dtype float16 or bfloat16 .*no float32 kernels.*dtype=float32"):
        create_attention_backend("flash-attn", torch.device("cuda"), 256, torch.float32)


def test_auto_picks_triton_on_cuda_when_flash_attn_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    monkeypatch.delitem(sys.modules, "kvserve.engine.layers.attention.flash_backend", raising=False)
    assert resolve_backend_name("auto", torch.device("cuda"), 256) == "triton"
    assert resolve_backend_name("auto", torch.device("cpu"), 16) == "torch"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_flash_attn_with_a_bad_block_size_names_block_size_and_the_rule(device):
    with pytest.raises(ValueError, match=r"block_size to be a multiple of 256 .*block_size=16"):
        create_attention_backend("flash-attn", torch.device(device), 16)


# ---------------------------------------------------------------- a whole engine, real CUDA graphs


@pytest.mark.skipif(not CUDA, reason="real CUDA graphs need a GPU (the logic above runs on the CPU)")
@pytest.mark.parametrize("shape", ["llama-tiny", "qwen3-tiny"])
def test_engine_with_cuda_graphs_generates_the_greedy_tokens_of_enforce_eager(shape, tmp_path):
    from kvserve.engine import LLM, SamplingParams
    from kvserve.testing.random_model import write_random_model

    model_dir = write_random_model(shape, tmp_path / shape, dtype=torch.float32)
    prompts = [[(13 * i + 5 * j) % 10240 for j in range(n)] for i, n in enumerate((5, 40, 17, 90, 3, 64, 8))]
    # a random model under plain greedy repeats its last token; the penalty makes each step's choice
    # depend on the context, and the logprobs show the logits themselves
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                            logprobs=1)
    outputs = {}
    for eager in (False, True):
        llm = LLM(str(model_dir), dtype="float32", max_num_seqs=8, max_model_len=256, num_kv_blocks=128,
                  enforce_eager=eager)  # fmt: skip
        runner = llm.engine.executor
        assert runner.attention_backend_name in ("triton", "flash-attn")
        assert (runner.graphs is None) == eager
        if not eager:
            assert runner.graphs.captured == [1, 2, 4, 8]
        outputs[eager] = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
    for graphed, eager in zip(outputs[False], outputs[True], strict=True):
        assert graphed.token_ids == eager.token_ids
        ours, theirs = ([lp.logprob for lp in out.logprobs] for out in (graphed, eager))
        assert len(ours) == 24 and ours == pytest.approx(theirs, abs=1e-4)
