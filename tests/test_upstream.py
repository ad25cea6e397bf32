"""common/upstream.py gathers every use of an upstream package's private attributes. Each test here fails once the
workaround may no longer be needed: a pinned version changed (re-check them all against the new release), or the
public API it stands in for appeared. Then rewrite the call site with the public API and delete the workaround."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import torch
from accelerate import Accelerator

from common.upstream import WRITTEN_FOR
from conftest import ROOT


def test_the_workarounds_were_written_for_the_pinned_and_installed_versions():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = dict(re.findall(r"^([A-Za-z0-9_-]+)==([^\s#]+)", f.read(), re.M))
    for package, version in WRITTEN_FOR.items():
        assert pins[package] == version, f"requirements.txt pins {package}=={pins[package]}: re-check common/upstream.py"
        installed = importlib.metadata.version(package).split("+")[0]
        assert installed == version, f"{package} {installed} is installed: re-check common/upstream.py"


def test_accelerate_has_no_public_list_of_prepared_objects_or_hooks():
    """prepared_models, prepared_optimizers_and_schedulers, save_state_pre_hooks,
    prepared_dataloaders_and_registered_objects."""
    public = {name for name in dir(Accelerator) if not name.startswith("_")}
    wanted = {"models", "optimizers", "schedulers", "prepared_models", "save_state_pre_hooks", "dataloaders",
              "custom_objects", "registered_objects"}
    assert not public & wanted, f"accelerate now offers {public & wanted}: use it in common/upstream.py's callers"


def test_torch_schedulers_have_no_setter_for_the_last_lr_and_the_private_one_works():
    """set_last_lr: a resume recomputes the rates; `get_last_lr()` must then return them."""
    from common.upstream import set_last_lr

    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                                  lambda step: 0.5)
    assert not any(name.startswith("set_") and "lr" in name for name in dir(scheduler))
    set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_torch_schedulers_cannot_undo_a_step_and_taking_back_the_count_restores_the_state():
    """take_back_step_count: a step skipped on the device is taken back from the schedule a step later (common/
    features/divergence.py); the state_dict must then equal one that never stepped."""
    from common.features.divergence import take_back_schedule_step

    def schedule():
        return torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                                 lambda step: 1.0 / (step + 1))

    stepped, untouched = schedule(), schedule()
    for s in (stepped, untouched):
        s.optimizer.step()
        s.step()
    stepped.optimizer.step()
    stepped.step()
    assert not any(name in ("unstep", "step_back") for name in dir(stepped))
    take_back_schedule_step(stepped)
    assert stepped.state_dict() == untouched.state_dict()
    assert stepped.optimizer.param_groups[0]["lr"] == untouched.optimizer.param_groups[0]["lr"] == 0.5


def test_transformers_public_deepspeed_getter_gives_the_dict_not_the_object():
    """registered_zero3_config: `set_hf_deepspeed_config` needs the HfDeepSpeedConfig object back, which only the
    private weak reference holds (`deepspeed_config()` returns its dict)."""
    import inspect

    from transformers.integrations import deepspeed as hf_deepspeed

    assert "_hf_deepspeed_config_weak_ref().config" in inspect.getsource(hf_deepspeed.deepspeed_config)


def test_tqdm_keeps_its_open_bars_where_the_workaround_reads_them():
    """open_progress_bars: closed before a run's last error line."""
    from tqdm import tqdm

    from common.upstream import open_progress_bars

    bar = tqdm(total=1, disable=False, file=open(os.devnull, "w"))
    try:
        assert bar in open_progress_bars()
    finally:
        bar.close()


def test_accelerate_still_turns_fsdp_into_ddp_on_cpu():
    """use_fsdp_everywhere: an FSDP launch built with `cpu=True` is not FSDP in accelerate's state."""
    code = ("from accelerate import Accelerator; from accelerate.utils import DistributedType; "
            "print(Accelerator(cpu=True).distributed_type == DistributedType.FSDP)")
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_configs_and_datasets_keep_no_public_name_for_what_is_read():
    """attention_implementation, dataset_fingerprint: transformers' config and a `datasets` table have no public
    attribute for the attention kernel or the content hash, and the private ones hold them."""
    import datasets
    from transformers import LlamaConfig

    from common.upstream import attention_implementation, dataset_fingerprint

    config = LlamaConfig(attn_implementation="eager")
    assert not hasattr(type(config), "attn_implementation") and attention_implementation(config) == "eager"
    table = datasets.Dataset.from_dict({"text": ["a", "b"]})
    assert not [n for n in dir(table) if "fingerprint" in n and not n.startswith("_")]
    assert dataset_fingerprint(table) == datasets.Dataset.from_dict({"text": ["a", "b"]})._fingerprint


def test_upstream_still_warns_where_the_recipes_silence_it():
    """Two FutureWarnings the recipes filter (not the user's to act on): peft's PeftModel reads transformers'
    deprecated `is_gradient_checkpointing`; datasets' `sort` passes pyarrow a deprecated option. Fails once upstream
    stops: then delete the filter in common/features/lora.py / common/inputs/batching.py."""
    import warnings

    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.features.lora import GRADIENT_CHECKPOINTING_NOTICE
    from common.inputs.batching import SORT_NOTICE

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
        datasets.Dataset.from_dict({"length": [3, 1, 2]}).sort("length")
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    for notice in (GRADIENT_CHECKPOINTING_NOTICE, SORT_NOTICE):
        assert any(notice in message for message in messages), f"upstream no longer warns {notice!r}: drop its filter"


def test_tqdm_still_redraws_a_finished_bar_and_data_bars_print_it_once():
    """tqdm's close() draws the last frame again; common/inputs/__init__.py skips that for datasets' bars, whose
    final 100 % line a log held twice. Fails once tqdm stops redrawing: then delete the patch."""
    import io

    from datasets.utils import tqdm as data_bar
    from tqdm import tqdm

    import common.inputs  # noqa: F401  (applies the patch)

    def frames(bar_class) -> list[str]:
        out = io.StringIO()
        for _ in bar_class(range(3), file=out, mininterval=0, miniters=1, desc="Tokenizing"):
            pass
        return [frame for frame in out.getvalue().split("\r") if "3/3" in frame]

    assert len(frames(tqdm)) == 2, "tqdm no longer redraws a finished bar: drop the patch in common/inputs"
    assert len(frames(data_bar)) == 1
