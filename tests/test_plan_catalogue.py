"""mgpu-plan on every causal-LM family the installed transformers offers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
each as a tiny config (``plan_sources.catalogue``): at least 95% of the families transformers itself can train
on a CPU get a plan; the others are skipped and counted, with the reason transformers gave.

Two processes plan the catalogue at once (spawned: each imports transformers once); about 2-4 minutes on
two cores. ``python -m pytest tests/test_plan_catalogue.py -s`` prints the counts by class."""
import os

import pytest

pytest.importorskip("transformers")

from mgpu_helpers.tools.plan_sources.catalogue import causal_lm_types, counts, plan_catalogue, plan_family  # noqa: E402


def test_a_family_is_planned_with_one_line_at_most_on_stderr(capfd):
    """Quick: a dense family and a mixture of experts, as the catalogue plans them; nothing on the process's
    stderr either (torch's and transformers' loggers write to the file descriptor, not sys.stderr)."""
    for t in ("llama", "qwen2_moe"):
        r = plan_family(t, checkpointing="on")
        assert r["result"] == "planned" and r["stderr_lines"] == 0, r
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_the_catalogue_plans_95_percent_of_what_transformers_trains(capfd):
    results = plan_catalogue(workers=min(2, os.cpu_count() or 1))
    logged = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    by_class = counts(results)
    print("\ncatalogue of", len(causal_lm_types()), "causal-LM types:", by_class)
    for r in results:
        if r["result"] != "planned" or r.get("note"):
            print(f"  {r['type']}: {r['result']}: {r.get('note') or r['message'][-200:]}")
    trainable = [r for r in results if not r["result"].startswith("skipped")]
    planned = [r for r in trainable if r["result"] == "planned"]
    failed = {r["type"]: r["message"][-160:] for r in trainable if r["result"] != "planned"}
    assert len(planned) >= 0.95 * len(trainable), failed
    # a failure is one line on stderr, never a library's log (the workers' stderr is the test's file descriptor)
    assert all(r.get("stderr_lines", 0) <= 1 for r in results), [r["type"] for r in results if r.get("stderr_lines", 0) > 1]
    assert not logged, logged[:5]
    # skipped families are counted, each with transformers' own reason
    assert all(r["message"] for r in results if r["result"].startswith("skipped"))
