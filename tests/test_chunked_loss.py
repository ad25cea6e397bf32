"""`--chunked_cross_entropy`: the LM head and its token loss over chunks of tokens (torch's `F.linear_cross_entropy`)
give the unchunked model's loss and gradients, and the same training under every engine.

In-process, fp32: loss within 1e-6 relative and every gradient within 1e-6 (relative Frobenius norm) of the float64
model's, as the unchunked model's are, for padded label rows, an accumulation window of two micro-batches sharing one
token count, and tied embeddings; logits without labels are unchanged. Through the script: one process unchunked is
the reference; chunked runs on 1 process (gradient checkpointing), 2 processes (DDP), ZeRO-3 and FSDP2 reproduce its
losses and weights to tests/test_distributed.py's tolerances; `--torch_compile` trains; SFT (packed) matches its
unchunked run; a resume may turn the flag on.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import copy_checkpoints, launcher, run_script
from test_distributed import assert_same_training, init_model, train_args  # noqa: F401  (fixture)
from test_finetune_causal_lm import finetune, max_difference, sft, weights  # noqa: F401  (fixture)
from test_fsdp import fsdp_launcher

from common.features.chunked_loss import use_chunked_loss


def tiny_pair(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=tie)
    plain = LlamaForCausalLM(config)
    chunked = copy.deepcopy(plain)
    use_chunked_loss(chunked)
    return plain, chunked


def window() -> list[dict]:
    """Two micro-batches of different lengths, with masked prompts and padding (-100 labels)."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for rows, length, masked in ((4, 160, 10), (2, 128, 3)):
        ids = torch.randint(0, 1000, (rows, length), generator=generator)
        labels = ids.clone()
        labels[0, :masked] = -100
        labels[-1, length - 5:] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def window_gradients(model, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """The window's loss and the gradients it accumulates (micro-batches share the window's token count)."""
    num_items = sum((b["labels"][:, 1:] != -100).sum() for b in batches)
    total = 0.0
    for batch in batches:
        outputs = model(**batch, num_items_in_batch=num_items, use_cache=False)
        outputs.loss.backward()
        total += outputs.loss.item()
    return total, {name: p.grad.double() for name, p in model.named_parameters()}


def relative(a: dict, b: dict) -> dict[str, float]:
    return {n: (torch.linalg.norm(a[n] - b[n]) / torch.linalg.norm(b[n])).item() for n in b}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_loss_and_gradients_equal_the_unchunked_ones(tie):
    """Loss and every gradient within 1e-6 of the unchunked fp32 model's and of the float64 model's (measured: chunked
    4.8e-7 from float64, unchunked 5.5e-7). Each micro-batch here is one chunk; the head test below runs 8 chunks."""
    plain, chunked = tiny_pair(tie)
    exact = copy.deepcopy(plain).double()
    batches = window()
    (loss, grads), (plain_loss, plain_grads) = window_gradients(chunked, batches), window_gradients(plain, batches)
    exact_loss, exact_grads = window_gradients(exact, batches)
    assert chunked(**batches[0]).logits is None and plain(**batches[0]).logits is not None  # no logits in training
    chunked_error, plain_error = relative(grads, exact_grads), relative(plain_grads, exact_grads)
    between = relative(grads, plain_grads)
    print(f"{'tied' if tie else 'untied'}: loss {loss:.8f}, unchunked {plain_loss:.8f}, float64 {exact_loss:.8f}; "
          f"largest gradient error against float64: chunked {max(chunked_error.values()):.1e}, unchunked "
          f"{max(plain_error.values()):.1e}; between them {max(between.values()):.1e}")
    assert loss == pytest.approx(plain_loss, rel=1e-6) and loss == pytest.approx(exact_loss, rel=1e-6)
    assert max(chunked_error.values()) <= 1e-6 and max(plain_error.values()) <= 1e-6
    assert max(between.values()) <= 1e-6
    ids = batches[0]["input_ids"]
    assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)


KERNELS = ["F.linear_cross_entropy", "checkpointed chunks"]  # torch 2.13's op; an older torch's stand-in


def without_linear_cross_entropy(monkeypatch) -> None:
    """As on a torch before 2.13 (the GPU machine's 2.11): no F.linear_cross_entropy, no options for it."""
    from common.features import chunked_loss

    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy")
    monkeypatch.setattr(chunked_loss, "OPTIONS", None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_gradients_equal_the_unchunked_ones(kernel, monkeypatch):
    """The loss and its gradients for the head's input and weight, 8,192 tokens (8 chunks) x vocabulary 4,000 in fp32,
    one in seven labels ignored: within 1e-6 of the unchunked head's (the op the flag swaps in), with torch's op and
    with the checkpointed chunks a torch without it gets. The chunks are of tokens, so the vocabulary's width does not
    change what is checked (32,000 took 20 s on one core)."""
    from common.features import chunked_loss
    from common.features.chunked_loss import _head_forward

    if kernel == "checkpointed chunks":
        without_linear_cross_entropy(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 2048, 64, generator=generator)
    head = torch.nn.Linear(64, 4000, bias=False)
    torch.nn.init.normal_(head.weight, std=0.02, generator=generator)
    labels = torch.randint(0, 4000, (4, 2048), generator=generator)
    labels[torch.rand(4, 2048, generator=generator) < 1 / 7] = -100
    results = []
    for chunked in (False, True):
        head.weight.grad, h = None, hidden.clone().requires_grad_()
        if chunked:
            loss = _head_forward(head, h, labels)
        else:
            logits = head(h)[:, :-1].reshape(-1, 4000)
            loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        results.append((loss.item(), h.grad, head.weight.grad))
    (plain_loss, plain_h, plain_w), (loss, h, w) = results
    errors = [(torch.linalg.norm(a - b) / torch.linalg.norm(b)).item() for a, b in ((h, plain_h), (w, plain_w))]
    print(f"head: loss {loss:.7f} vs {plain_loss:.7f}; input gradient {errors[0]:.1e}, weight gradient {errors[1]:.1e}")
    assert loss == pytest.approx(plain_loss, rel=1e-6) and max(errors) <= 1e-6


def test_checkpointed_chunks_keep_no_logits_for_the_backward(monkeypatch):
    """Without F.linear_cross_entropy the chunks keep only their inputs for the backward: no tensor saved by the
    forward is larger than the head's input or weight, where the unchunked loss saves tokens x vocabulary (its
    log-softmax). Under bf16 autocast the weight's gradient adds up in fp32 and equals the unchunked one's to
    bf16 rounding."""
    from common.features import chunked_loss

    without_linear_cross_entropy(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    tokens, vocab = 3000, 2000  # 3 chunks, the last one short
    hidden = torch.randn(1, tokens, 32, generator=generator, requires_grad=True)
    head = torch.nn.Linear(32, vocab, bias=False)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = chunked_loss._head_forward(head, hidden, labels)
    assert max(saved) <= max(hidden.numel(), head.weight.numel()) < tokens * vocab
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        torch.nn.functional.cross_entropy(head(hidden)[0, :-1], labels[0, 1:])
    assert max(saved) >= (tokens - 1) * vocab  # what the chunks save us
    grads = []
    for chunked in (True, False):
        head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                loss = chunked_loss._head_forward(head, hidden, labels)
            else:
                loss = torch.nn.functional.cross_entropy(head(hidden)[0, :-1].float(), labels[0, 1:])
        loss.backward()
        grads.append(head.weight.grad)
    assert grads[0].dtype == torch.float32
    assert (torch.linalg.norm(grads[0] - grads[1]) / torch.linalg.norm(grads[1])).item() < 1e-2


def test_bf16_autocast_keeps_the_loss_exact():
    """Under bf16 autocast the head runs in bf16 (as unchunked) and the per-token losses are summed in fp32."""
    plain, chunked = tiny_pair(tie=False)
    batch = window()[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference, loss = plain(**batch).loss.item(), chunked(**batch).loss.item()
    exact = plain(**batch).loss.item()
    print(f"bf16: chunked {loss:.5f}, unchunked {reference:.5f}, fp32 {exact:.5f}")
    assert loss == pytest.approx(exact, rel=2e-3) and reference == pytest.approx(exact, rel=2e-3)


@pytest.fixture(scope="module")
def reference(corpus, init_model, tmp_path_factory):  # noqa: F811
    """One process, unchunked, 4 sequences x 2 accumulation steps (tests/test_distributed.py's reference run)."""
    out = tmp_path_factory.mktemp("chunked") / "reference"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4), launcher=launcher("cpu_1proc.yaml", 1))
    return out


ENGINES = {
    "1 process, gradient checkpointing": (lambda: launcher("cpu_1proc.yaml", 1), 4, ["--gradient_checkpointing"]),
    "DDP": (lambda: launcher("cpu_2proc.yaml"), 2, []),
    "ZeRO-3": (lambda: launcher("deepspeed_zero3.yaml"), 2, []),
    "FSDP2": (lambda: fsdp_launcher(2), 2, []),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_chunked_training_matches_the_unchunked_one_process_run(engine, corpus, init_model, reference,  # noqa: F811
                                                                tmp_path):
    make_launcher, per_device_batch, extra = ENGINES[engine]
    out = tmp_path / "run"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, per_device_batch, "--chunked_cross_entropy",
                                                "--sample_max_new_tokens", "8", *extra), launcher=make_launcher())
    print(f"chunked, {engine}: {assert_same_training(out, reference)}")


def test_torch_compile_trains_with_chunked_loss_and_exports_plain_weights(corpus, init_model, reference,  # noqa: F811
                                                                          tmp_path):
    """The whole model compiled (--torch_compile_whole_model; the regional default is tests/test_compile.py's), the
    chunked op runs eagerly (a graph break); the losses stay the unchunked run's (1e-4). The export has no `_orig_mod.`
    keys, loads with no missing or unexpected weights and generates. Traced with `aot_eager` (dynamo's graphs, the
    graph break and the wrapper inductor would get, no kernels: a cold inductor build of the whole model took 44 s of
    the suite's time); inductor's numerics are tests/test_compile.py's (regional, 1 and 2 processes)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_distributed import train_rows

    out = tmp_path / "compiled"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4, "--chunked_cross_entropy",
                                                "--torch_compile", "--torch_compile_whole_model",
                                                "--torch_compile_backend", "aot_eager", "--max_steps", "2",
                                                "--sample_max_new_tokens", "8"))
    run, ref = train_rows(out), train_rows(reference)
    assert sorted(run) == [1, 2]
    for step in run:
        assert run[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-4)
    assert not [k for k in load_file(out / "model.safetensors") if "_orig_mod" in k]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    generated = model.generate(**tokenizer("the model", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == len(tokenizer("the model")["input_ids"]) + 5
    assert json.loads((out / "all_results.json").read_text())["sample"].startswith("def")


def test_sft_with_chunked_loss_matches_unchunked(sft, tmp_path):  # noqa: F811
    plain = finetune(sft, str(tmp_path / "plain"), "--packing", "--per_device_train_batch_size", "4",
                     "--gradient_accumulation_steps", "2")
    chunked = finetune(sft, str(tmp_path / "chunked"), "--packing", "--per_device_train_batch_size", "4",
                       "--gradient_accumulation_steps", "2", "--chunked_cross_entropy")
    difference = max_difference(weights(plain), weights(chunked))
    print(f"SFT packed, chunked vs unchunked: max weight difference {difference:.1e}")
    assert difference <= 1e-5


def test_mixture_of_experts_is_refused_in_one_line(tmp_path):
    proc = run_script("pretrain_llama.py", "--model_preset", "moe-tiny", "--chunked_cross_entropy", "--output_dir",
                      str(tmp_path / "out"), check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --chunked_cross_entropy does not add a mixture of experts' load-balancing loss: leave "
                      "it off for mixtral with output_router_logits"], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_resume_that_turns_chunking_on_continues_the_run(corpus, init_model, reference, tmp_path):  # noqa: F811
    """The flag changes how the loss is computed, not what it is: a run checkpointed at step 2 without it and resumed
    with it ends at the uninterrupted unchunked run's losses and weights (so a resume may toggle it)."""
    first = tmp_path / "first"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, first, 4, "--checkpointing_steps", "2"),
               launcher=launcher("cpu_1proc.yaml", 1))  # the same 4-step schedule; its step-2 state is resumed
    resumed = tmp_path / "resumed"
    copy_checkpoints(first, resumed, 2)
    run_script("pretrain_llama.py", *train_args(corpus, init_model, resumed, 4, "--chunked_cross_entropy",
                                                "--resume_from_checkpoint", "latest"),
               launcher=launcher("cpu_1proc.yaml", 1))
    print(f"unchunked to step 2, chunked from there: {assert_same_training(resumed, reference, steps=(3, 4))}")
