"""`--use_liger_kernel` (common/features/liger.py): refused in one line where Liger cannot run, before any model is
loaded; the patch function picked by model type; what the patch replaces in transformers put back. Liger's kernels
themselves need CUDA: their loss equals transformers' in the GPU suite's liger rows (docs/gpu-suite.md)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import BertConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MixtralConfig
from transformers.models.llama import modeling_llama

from common.features import liger
from common.inputs.modeling import LLAMA_PRESETS
from tests.conftest import run_script

RECIPES = ("pretrain_llama.py", "finetune_causal_lm.py", "finetune_dpo.py")


@pytest.fixture(scope="module")
def unloadable_model(tmp_path_factory) -> str:
    """A model folder with a config, a tokenizer and a weights file whose embedding has the wrong shape: a recipe
    that loads the model fails there."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("unloadable")
    LlamaConfig(**LLAMA_PRESETS["tiny"]).save_pretrained(path)
    save_file({"model.embed_tokens.weight": torch.zeros(1, 1)}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<unk>").save_pretrained(path)
    return str(path)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_cpu_machine_is_refused_in_one_line_before_the_model_is_loaded(recipe, unloadable_model, tmp_path):
    out = tmp_path / "out"
    proc = run_script(recipe, "--model_name_or_path", unloadable_model, "--use_liger_kernel", "--output_dir",
                      str(out), check=False)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == ["error: --use_liger_kernel: Liger's Triton kernels run on CUDA GPUs only, "
                                        "and this machine has none"], proc.stderr[-2000:]
    assert not out.exists()


def test_without_the_flag_the_same_run_gets_as_far_as_loading_the_weights(unloadable_model, tmp_path):
    """The control of the test above: the weights cannot load, so a refusal after loading would never be seen."""
    proc = run_script("finetune_causal_lm.py", "--model_name_or_path", unloadable_model, "--max_steps", "1",
                      "--output_dir", str(tmp_path / "out"), check=False)
    assert proc.returncode != 0
    assert "ignore_mismatched_sizes" in proc.stderr, proc.stderr[-2000:]


def fake_patch(model=None, fused_linear_cross_entropy=True):
    """Does what liger's apply functions do: the family's rope function and layer classes replaced in its modeling
    module, the forward replaced on the instance."""
    fake_patch.calls.append((model, fused_linear_cross_entropy))
    modeling_llama.apply_rotary_pos_emb = lambda *a, **k: None
    modeling_llama.LlamaRMSNorm = type("FakeRMSNorm", (torch.nn.Module,), {})
    model.forward = lambda *a, **k: None


@pytest.fixture
def on_cuda(monkeypatch):
    """A machine with CUDA, as far as the checks can tell, whose liger table is llama's fake patch alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(liger, "liger_table", lambda: {"llama": fake_patch, "mistral": print})
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    fake_patch.calls = []


def refusal(capsys, check, *args, **kwargs) -> str:
    with pytest.raises(SystemExit) as stop:
        check(*args, **kwargs)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip()


def test_an_unsupported_model_type_is_refused_with_the_supported_ones(on_cuda, capsys):
    assert refusal(capsys, liger.check_liger_kernel, BertConfig(), fused_loss=True) == (
        "error: --use_liger_kernel: liger-kernel has no kernels for model type bert; it has them for llama, mistral")
    liger.check_liger_kernel(LlamaConfig(), fused_loss=True)  # a supported type passes


def test_the_fused_loss_is_refused_with_chunked_cross_entropy_and_under_zero3(on_cuda, capsys, monkeypatch):
    assert refusal(capsys, liger.check_liger_kernel, LlamaConfig(), True, chunked_cross_entropy=True) == (
        "error: --use_liger_kernel and --chunked_cross_entropy both compute the loss without the full logits: pick "
        "one")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert "under DeepSpeed ZeRO-3" in refusal(capsys, liger.check_liger_kernel, LlamaConfig(), fused_loss=True)
    # DPO (no fused loss): both combinations are served, the log-probabilities come from the logits or the chunks
    liger.check_liger_kernel(LlamaConfig(), fused_loss=False, chunked_cross_entropy=True)


def test_a_missing_liger_or_triton_is_refused_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # ImportError
    line = refusal(capsys, liger.liger_table)
    assert line.startswith("error: --use_liger_kernel needs liger-kernel and Triton (")
    assert line.endswith("): pip install liger-kernel==0.8.5")


def test_the_patch_gets_the_model_and_the_loss_choice_and_transformers_is_put_back(on_cuda):
    before = dict(vars(modeling_llama))
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_PRESETS["tiny"]))
    try:
        liger.use_liger_kernel(model, fused_loss=False)
        assert fake_patch.calls == [(model, False)]
        assert modeling_llama.LlamaRMSNorm is not before["LlamaRMSNorm"]
    finally:
        liger.undo_liger_kernel()
    changed = [name for name, value in vars(modeling_llama).items() if before.get(name) is not value]
    assert changed == []
    assert "forward" in vars(model)  # the patched model keeps its kernels
    liger.undo_liger_kernel()  # twice, or without the flag: nothing


# With liger-kernel and Triton importable (a GPU machine, or a CPU one with Triton installed): liger's own table.
@pytest.mark.parametrize("config, name", [(LlamaConfig(), "apply_liger_kernel_to_llama"),
                                          (MistralConfig(), "apply_liger_kernel_to_mistral"),
                                          (MixtralConfig(), "apply_liger_kernel_to_mixtral")])  # --model_preset moe-tiny
def test_liger_picks_the_patch_of_the_models_family(config, name):
    table = pytest.importorskip("liger_kernel.transformers.monkey_patch").MODEL_TYPE_TO_APPLY_LIGER_FN
    assert liger.liger_patch(config.model_type, table).__name__ == name


def test_liger_own_patch_is_put_back_and_keeps_the_state_dict(monkeypatch):
    pytest.importorskip("liger_kernel.transformers.monkey_patch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = dict(vars(modeling_llama))
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_PRESETS["tiny"]))
    keys = list(model.state_dict())
    try:
        liger.use_liger_kernel(model, fused_loss=True)
        assert modeling_llama.apply_rotary_pos_emb.__name__ == "liger_rotary_pos_emb"
        assert list(model.state_dict()) == keys
    finally:
        liger.undo_liger_kernel()
    assert [name for name, value in vars(modeling_llama).items() if before.get(name) is not value] == []
    fresh = LlamaForCausalLM(LlamaConfig(**LLAMA_PRESETS["tiny"]))  # built after the undo: transformers' own layers
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(fresh(input_ids=ids, labels=ids).loss)  # on a CPU: no Triton kernel in it
