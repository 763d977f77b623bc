"""The offline benchmark's ``--json-schema FILE`` runs end to end on a tiny random model (with
the default model's byte-level tokenizer, which can spell JSON) and prints the cost per step of
the constraint against the same run without it."""

from pathlib import Path

import kvserve.benchmarks
from kvserve.benchmarks import offline

SCHEMA = Path(kvserve.benchmarks.__file__).with_name("fruit_schema.json")


def test_offline_benchmark_json_schema_prints_overhead_per_step(tiny_qwen2_dir, capsys):
    offline.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--num-requests", "4",
                  "--min-prompt", "8", "--max-prompt", "24", "--min-output", "4", "--max-output", "12",
                  "--json-schema", str(SCHEMA), "--quiet"])
    out = capsys.readouterr().out
    assert "json schema  compile" in out and "structured-output overhead =" in out, out
    constrained, plain = (line for line in out.splitlines() if line.startswith(("constrained", "plain")))
    assert constrained.split()[3] == plain.split()[3]  # the same number of steps


def test_a_vocabulary_that_cannot_spell_the_constraint_aborts_the_request_alone(tmp_path):
    """A word-level vocabulary of "<tN>" tokens has no token for '{': the request ends with
    ABORT (its refused token is not turned into text) and the engine goes on serving."""
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.sequence import FinishReason
    from kvserve.testing.random_model import write_random_model

    model = str(write_random_model("llama-tiny", tmp_path / "llama-tiny"))
    with LLM(model, dtype="float32") as llm:
        bad, good = llm.generate([[5, 6, 7], [5, 6, 7]], [
            SamplingParams(max_tokens=8, json_object=True), SamplingParams(max_tokens=8, ignore_eos=True),
        ], use_tqdm=False)
        assert bad.finish_reason == FinishReason.ABORT and bad.text == "" and len(bad.token_ids) == 1
        assert good.finish_reason == FinishReason.LENGTH and len(good.token_ids) == 8
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
