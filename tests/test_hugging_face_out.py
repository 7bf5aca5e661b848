"""Hugging Face out as in: where the trained model is a transformers PreTrainedModel, every script also writes
--output-dir/hf/ with save_pretrained, which from_pretrained reads back to the trained model (the same logits); a
PEFT (LoRA) model writes its adapter alone, which PeftModel.from_pretrained puts on the base model. Under FSDP the
weights are gathered once, on rank 0, for model.pt and hf/ alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from processes import run_parallel, weights
from projects import YOUR_LANGUAGE_MODEL
from projects import copy_with_your_functions, launch, users_code

peft = pytest.importorskip("peft")  # a test-only dependency (tests/requirements.txt)

# the small GPT-2 of the FSDP tests, with LoRA on its attention where LORA is set
YOURS = YOUR_LANGUAGE_MODEL.replace(
    """def build_model(args, num_classes):
    return GPT2LMHeadModel(CONFIG)  # its head is tied to its token embedding""",
    """import os

from peft import LoraConfig, get_peft_model

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)


def build_model(args, num_classes):
    model = GPT2LMHeadModel(CONFIG)  # its head is tied to its token embedding
    return get_peft_model(model, LORA) if os.environ.get("LORA") else model""",
)
assert YOURS != YOUR_LANGUAGE_MODEL
SCRIPTS = {
    "dataparallel.py": 1,
    "distributed.py": 2,
    "distributed_mp.py": 2,
    "distributed_amp.py": 2,
    "distributed_grad_accum.py": 2,
    "distributed_fsdp.py": 2,
}
FLAGS = [
    "--batch-size",
    "32",
    "--epochs",
    "1",
    "--workers",
    "0",
    "--timeout",
    "60",
    "--optimizer",
    "adamw",
    "--lr",
    "1e-2",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The small GPT-2 trained by every script, and with LoRA by distributed.py and distributed_fsdp.py: all at once."""
    base = tmp_path_factory.mktemp("hugging-face-out")
    runs = {(script, False): processes for script, processes in SCRIPTS.items()}
    runs.update({("distributed.py", True): 2, ("distributed_fsdp.py", True): 2})
    commands = []
    for (script, lora), processes in runs.items():
        copy = copy_with_your_functions(script, base / f"copy-{script}", YOURS)
        flags = [*FLAGS, *(["--amp-dtype", "bfloat16"] if script == "distributed_amp.py" else [])]
        out = base / f"{script}{'-lora' if lora else ''}"
        commands.append(
            (
                launch(copy, processes, *flags, "--output-dir", out),
                {"LORA": "1"} if lora else {},
                base,
            )
        )
    run_parallel(commands, timeout=400)
    return base


def logits(model, yours) -> torch.Tensor:
    inputs, _ = yours["collate"]([yours["Progressions"](8, seed=3)[i] for i in range(8)])
    with torch.no_grad():
        return model.eval()(**inputs).logits


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_hugging_face_model_comes_out_for_from_pretrained(script, trained):
    yours = users_code(YOURS)
    out = trained / script
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "hf").iterdir()}
    model = yours["GPT2LMHeadModel"](yours["CONFIG"])
    saved = weights(out)  # the checkpoint's (FSDP: model.pt's) trained weights
    model.load_state_dict(saved)
    loaded = yours["GPT2LMHeadModel"].from_pretrained(out / "hf")
    assert torch.equal(logits(loaded, yours), logits(model, yours))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    # the tied head saved once: one tensor for both keys (FSDP gathers each key apart), and hf/ without it
    head, embedding = saved["lm_head.weight"], saved["transformer.wte.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    with safe_open(out / "hf" / "model.safetensors", "pt") as f:
        assert "transformer.wte.weight" in f.keys() and "lm_head.weight" not in f.keys()
    if script == "distributed_fsdp.py":  # and in the sharded checkpoint
        saved = dcp.FileSystemReader(out / "checkpoint").read_metadata().state_dict_metadata
        assert "model.transformer.wte.weight" in saved and "model.lm_head.weight" not in saved


@pytest.mark.parametrize("script", ["distributed.py", "distributed_fsdp.py"])
def test_a_lora_model_comes_out_as_its_adapter_alone(script, trained):
    """PEFT's save_pretrained of the whole trained state (gathered once under FSDP) keeps the adapter's tensors:
    PeftModel.from_pretrained on the base model the run started from gives the trained model."""
    yours = users_code(YOURS)
    out = trained / f"{script}-lora"
    assert {p.name for p in (out / "hf").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "README.md",
    }

    def base():  # what build_model built first: the script's seed, nothing drawn before it
        torch.manual_seed(0)
        return yours["GPT2LMHeadModel"](yours["CONFIG"])

    trained_model = peft.get_peft_model(base(), yours["LORA"])
    trained_model.load_state_dict(weights(out))  # all 33 tensors, base_model.model. names
    loaded = peft.PeftModel.from_pretrained(base(), out / "hf")
    assert torch.equal(logits(loaded, yours), logits(trained_model, yours))
    assert not torch.equal(logits(loaded, yours), logits(base(), yours))  # the adapter was trained
