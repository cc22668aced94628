"""QLoRA's live export, on bitsandbytes' CPU path. On the H200 (gpu_check.sh, 4 December 2026) a QLoRA run
trained its 10 steps and then failed in the export: the gathered state of a 4-bit base is bitsandbytes' packed
storage and quantization state (``weight`` as ``[n, 1]``, ``weight.absmax``, ``weight.quant_map``, ...), and
the export loaded it, strictly, into a full-precision architecture.

Truth by construction: a 4-bit base (the recipe's own quantization config) with LoRA adapters whose B matrices
are set to known non-zero values (at init they are zero and would hide a wrong adapter); the export of its state
must write exactly those adapters (and no base weight), and the adapter reloaded on the base quantized the same
way must give the live model's logits. FSDP on CPU cannot run a 4-bit base (bitsandbytes' CPU state dict expects uint8 storage;
the recipe stores in model.dtype for FSDP), so the state here is the single process's, with the same keys."""

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("bitsandbytes")

from shardlight.adapters import ADAPTER_NAME, quantization_config  # noqa: E402
from shardlight.build.training_model import build_hf_config, build_training_model  # noqa: E402
from shardlight.checkpoint.adapter_export import _peft_on_meta, write_referenced_adapter  # noqa: E402
from shardlight.checkpoint.export import check_batch  # noqa: E402
from shardlight.recipe import load_recipe  # noqa: E402


def test_qlora_export_writes_the_trained_adapters_and_reproduces_the_live_logits(tmp_path):
    # The default recipe's tiny Llama (hidden 128: bitsandbytes' CPU path needs rows of at least one 64-block).
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(build_hf_config(load_recipe(None, []).model)).save_pretrained(base)
    cfg = load_recipe(str(REPO / "recipes" / "tiny-llama-lora.yaml"),
                      ["peft.method=qlora", f"model.name_or_path={base}", "model.config=null"])
    live = build_training_model(cfg).eval()
    assert type(live.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    generator = torch.Generator().manual_seed(7)
    trained = {}
    with torch.no_grad():
        for name, param in live.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
                trained[name] = param.detach().clone()
    assert trained
    with torch.no_grad():
        reference = live(input_ids=check_batch(live.config.vocab_size)).logits.float()
    state = {"model." + key: value for key, value in live.state_dict().items()}
    assert any(key.endswith(".weight.absmax") for key in state)  # the 4-bit storage, as gathered on the GPU

    # What the export did before: a strict load of every gathered entry into the full-precision architecture.
    weights = {key[len("model."):]: value for key, value in state.items()}
    with pytest.raises(RuntimeError, match="absmax"):
        _peft_on_meta(live.config, live.peft_config[ADAPTER_NAME]).load_state_dict(weights, strict=True, assign=True)

    report = write_referenced_adapter(state, config=live.config, peft_config=live.peft_config[ADAPTER_NAME],
                                      tokenizer=None, out_dir=tmp_path / "model", reference_logits=reference,
                                      base_model=str(base))
    assert report["max_abs_diff"] == 0.0, report
    saved = load_file(str(tmp_path / "model" / "adapter" / "adapter_model.safetensors"))
    assert all("lora_" in key for key in saved)
    saved_b = {key: value for key, value in saved.items() if "lora_B" in key}
    assert len(saved_b) == len(trained)
    for name, value in trained.items():
        key = name.replace(f".{ADAPTER_NAME}.", ".")  # peft saves without the adapter name
        assert torch.equal(saved_b[key], value), key
    # The adapter reloaded on the base quantized as the run quantized it gives the live model's logits.
    from peft import PeftModel

    quantized = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                     quantization_config=quantization_config(cfg), device_map={"": "cpu"})
    reloaded = PeftModel.from_pretrained(quantized, str(tmp_path / "model" / "adapter")).eval()
    check = load_file(report["check_file"])
    with torch.no_grad():
        logits = reloaded(input_ids=check["input_ids"]).logits.float()
    assert float((logits - reference).abs().max()) <= 1e-5
