"""The whole stack with Hugging Face weights in and out (issue 42): a job created with only
`init_from` (a tiny Llama under the weights root, sharded) trains the model its config.json
describes (stored as a model, resolved by the agents' ranks, each loading its boxes), writes a
checkpoint, and `dynaplane export` has the control worker (the `exports` queue) write it back as a
Hugging Face directory in the source's file split, with its config.json, that transformers loads;
the trained tensors are not the source's."""
from __future__ import annotations

import json
import os

import pytest
import torch

from dynaplane.cli import main
from tests.support.stack import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_job_from_hf_weights_trains_and_exports_back(stack, capsys) -> None:
    from parallelism.hf_weights import read_hf_tensors
    from tests.parallelism.hf_weights.test_export import weights
    from tests.parallelism.hf_weights.tiny_hf import save_hf_model

    source = save_hf_model("llama", stack.var_dir / "weights" / "team" / "tiny-llama", max_shard_size="20KB")
    job = stack.post("api/jobs", {"name": "from-hf", "init_from": "team/tiny-llama", "gpus": 2, "global_batch": 4,
                                  "seq_len": 16, "max_steps": 2, "checkpoint_interval": 2})
    assert (job["model"], job["init_from"]) == ("team--tiny-llama", "team/tiny-llama")
    wait_for(lambda: stack.get(f"api/jobs/{job['id']}")["state"] in ("stopped", "failed"), timeout=150)
    row = stack.get(f"api/jobs/{job['id']}")
    assert (row["state"], row["step"], row["checkpoint_step"]) == ("stopped", 2, 2), row["error"]
    api = ["--url", stack.url, "--token", stack.state["token"]]
    assert main(["export", "from-hf", "--json", *api]) == 0
    done = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (done["state"], done["path"], done["checkpoint_step"]) == ("done", "from-hf-step-2", 2), done
    out = stack.var_dir / "exports" / "from-hf-step-2"
    # The source's split, names, dtypes and config.json; trained values.
    before, after = weights(source), weights(str(out))
    assert {n: (f, t.dtype, t.shape) for n, (f, t) in before.items()} == {
        n: (f, t.dtype, t.shape) for n, (f, t) in after.items()}
    assert (out / "config.json").read_bytes() == (stack.var_dir / "weights" / "team" / "tiny-llama" /
                                                   "config.json").read_bytes()
    assert any(not torch.equal(before[n][1], after[n][1]) for n in before)  # it trained
    assert done["files_written"] == len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    exported = read_hf_tensors(str(out))
    assert torch.equal(model.model.embed_tokens.weight, exported["llm.embed.weight"])
