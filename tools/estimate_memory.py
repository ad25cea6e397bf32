#!/usr/bin/env python
"""Which launch config fits a model: per-GPU and host memory of every option in accelerate_configs/, as Markdown;
or, given one exact command after `--`, that run's peak per GPU, its parts and whether it fits a GPU.

    python tools/estimate_memory.py --gpu_memory_gb 24 -- scripts/finetune_causal_lm.py \
        --model_name_or_path meta-llama/Llama-3.1-8B --use_peft --bf16 --gradient_checkpointing \
        --max_seq_length 2048 --per_device_train_batch_size 2          # add --json for one JSON object
    python tools/estimate_memory.py --model_preset 1b --num_gpus 1 --gpu_memory_gb 80
    python tools/estimate_memory.py --params 70e9 --num_gpus 16 --gpus_per_node 8 --gpu_memory_gb 80
    python tools/estimate_memory.py --config_name meta-llama/Llama-3.1-8B --seq_len 4096 --micro_batch_size 1
    python tools/estimate_memory.py --model_preset 8b --vocab_size 128256 --gpu_memory_gb 24 --micro_batch_size 2 \
        --use_peft      # + a table: full fine-tuning vs LoRA vs QLoRA on one GPU
    python tools/estimate_memory.py --model_preset 1b --gpu_memory_gb 80 --dpo   # + DPO: policy + reference

Accounting, in bytes per parameter (Ψ parameters, N GPUs in all, bf16 mixed precision, AdamW):
- Plain PyTorch with autocast (single_gpu.yaml, multi_gpu.yaml): fp32 weights 4 + fp32 gradients 4 + Adam m and v 8
  + the bf16 weight copies autocast keeps for the backward pass 2 = 18. DDP adds its gradient buckets, a second fp32
  copy of the gradients: 22. 8-bit AdamW (bitsandbytes) stores m and v in 1 byte each: 6 less.
- DeepSpeed ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054): bf16 weights 2 + bf16 gradients 2 + K = 12 optimizer
  bytes (fp32 master weights, m, v), of which stage 1 partitions the optimizer (4 + 12/N), stage 2 also the
  gradients (2 + 14/N), stage 3 also the weights (16/N). With a client 8-bit optimizer K = 6.
- FSDP2 full shard: fp32 weights, gradients, m and v all sharded: 16/N.
- ZeRO-3 and FSDP2 also hold the gathered bf16 weights and gradients of the unit being computed (4 bytes per
  parameter of the largest decoder layer or embedding).
- Offload: ZeRO-2 moves fp32 master weights, m, v and the fp32 gradients to host RAM (16 per parameter, over the
  nodes), the GPU keeps bf16 weights (2) and its gradient partition (2/N). ZeRO-3 with parameter offload keeps only
  the unit being computed on the GPU; host RAM holds 18 per parameter (+ bf16 weights).
- Activations per GPU in every table (`peak_activations`): what a full fine-tuning's peak (`peak_memory`, below) adds
  to its model states, so the configs' table, --activation_modes, --use_peft, --dpo (2b rows) and one command state
  the same figures; plain PyTorch's autocast copies (2 bytes per parameter) count only without checkpointing.
- `activation_bytes` (the GPU suite's rows; Korthikanti et al. 2022, arXiv:2205.05198), micro-batch b, sequence s,
  hidden h, L layers, a heads: L·s·b·h·(34 + 5·a·s/h) bytes with eager attention; SDPA/flash attention never stores
  the s×s scores: L·s·b·h·34. Tensor parallelism over t GPUs (no sequence parallelism) splits the tensors as wide as
  the heads or the MLP and leaves those of the hidden width (layer input, norm outputs, residual adds, o/down outputs)
  whole on every GPU: L·s·b·h·(10 + 24/t + 5·a·s/(h·t)) (Korthikanti's Table 2). With --gradient_checkpointing only
  each layer's bf16 input stays (2·s·b·h·L) plus one layer's activations while it is recomputed. Logits add s·b·V·12
  at the loss's backward (the fp32 log-softmax, its gradient and the input's gradient; measured on a CPU); with
  --chunked_cross_entropy only one chunk of 1,024 tokens exists at a time (`logits_bytes`).
- One run on one GPU (one command after --, the --use_peft and --activation_modes tables, the GPU suite's memory
  rows): `peak_memory`, by category, the larger of the loss's backward and a decoder layer's backward, a Llama
  layer's activations counted op by op (`layer_activation_bytes`); checked against torch's memory profiler on a CPU,
  within 5 % on held-out shapes (tests/test_memory_estimate.py, docs/configs-and-memory.md).
- Activation modes (--activation_modes), bytes a token keeps per decoder layer: none 34·h; full checkpointing 2·h
  (the layer's bf16 input); every k-th layer checkpointed: the mean of the two over the layers; per op (selective):
  the bf16 outputs of the matmuls and attention, 2·(q + k + v + attention + o + gate + up + down); offload: 0 on the
  GPU. All but none add one layer's 34·h while it runs or is recomputed. The longest sequence is the largest multiple
  of 1,024 tokens whose total (model states + activations + one chunk of the logits) fits.
- Tensor parallelism (tp.yaml: TP over all N GPUs; fsdp2_tp.yaml: TP 2 within groups, FSDP2 across N/2): every
  parameter is split over the TP group but the norms, which are replicated, so a process holds norms + rest/t
  parameters at 16 bytes each (fp32 weights, gradients, m, v; FSDP2's dp_shard divides that again), plus the gathered
  bf16 unit's share. The logits stay whole (the LM head's output is gathered).
- Host RAM per node: every process first builds the fp32 model on the CPU (4 per parameter) except under ZeRO-3
  (built partitioned) and FSDP2 with cpu_ram_efficient_loading (rank 0 only); offloaded states come on top.
- LoRA / QLoRA (--use_peft adds their table; one GPU or DDP, where each GPU holds the whole base): the frozen base
  in bf16 (2) or, for QLoRA, its linear layers' weights in 4 bits (0.5, + a 4-byte scale per 64 weights, or with
  nested quantization a 1-byte scale per 64 and a 4-byte one per 64 x 256) and the rest (embeddings, head, norms) in
  bf16; plus the adapter (rank r on every linear layer but the head: r x (inputs + outputs) parameters each) with
  fp32 weights, gradients and AdamW m and v: 16 per adapter parameter; plus, for QLoRA, one linear layer dequantized
  to bf16 at a time. Activations as above: the backward pass still runs through the frozen layers.
- DPO (--dpo adds its table; one GPU or DDP): the policy as above with 2 x micro-batch rows (chosen and rejected in
  one forward), plus the reference: live, a frozen fp32 copy (4 per parameter; fp32 so that both models compute alike)
  and its no-grad forward's logits (6 bytes per token per vocabulary entry, one micro-batch at a time); precomputed
  (--precompute_ref_log_probs), nothing during training; with LoRA / QLoRA, nothing (the adapter disabled).
- Vision-language (scripts/finetune_vlm.py, one command): the language model as above, --max_seq_length counting the
  image tokens; every parameter holds its weights, the frozen parts (--freeze_vision_tower, --freeze_projector) no
  gradients or optimizer states; a trained vision encoder keeps 34·h_v bytes per encoder token and layer (4·h_v, its
  fp32 input, with checkpointing): --image_patches tokens an image (default: the config's image_size/patch_size),
  --images_per_row images a row. LoRA adapts the language model only; the encoder then keeps nothing.
A config "fits" when its per-GPU total stays under 90% of the GPU's memory (the rest: CUDA context, allocator
fragmentation, communication buffers), and its host total under 90% of --host_memory_gb when that is given. The
pick is the first fitting row (rows run fastest first), preferring activation checkpointing (~20-30% slower) to
offload (the optimizer step then runs on the CPU).
Estimates, not measurements: check the first steps' peak_memory_bytes in metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import urllib.parse
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from common.flags import ArgumentParser  # noqa: E402
from common.features import chunked_loss  # noqa: E402
from common.features.chunked_loss import CHUNK_TOKENS  # noqa: E402
from common.errors import fail  # noqa: E402
from common.inputs.modeling import PRESETS  # noqa: E402

GB = 1e9
HEADROOM = 0.9


@dataclass
class ModelShape:
    params: int
    largest_unit: int  # parameters gathered at once under ZeRO-3 / FSDP2
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    linear: int | None = None  # weights of the linear layers LoRA adapts (all but the output head): 4-bit in QLoRA
    largest_linear: int | None = None
    lora_per_rank: int | None = None  # adapter parameters per unit of rank: the sum of inputs + outputs
    intermediate: int | None = None  # the MLP's width
    kv_hidden: int | None = None  # keys' (and values') width: heads of keys x head size
    replicated: int = 0  # parameters tensor parallelism leaves whole on every GPU (the norms); 0 when unknown
    vision_params: int = 0  # a vision-language model's vision encoder (its projector apart)
    projector_params: int = 0
    vision_layers: int = 0
    vision_hidden: int = 0
    image_patches: int | None = None  # the encoder's tokens per image (from image_size and patch_size), if fixed


@dataclass
class Option:
    config: str          # file in accelerate_configs/
    flags: str           # script flags it needs
    what: str
    states: float        # bytes per GPU: weights, gradients, optimizer states (and gathered unit)
    host: float          # bytes per node
    bytes_per_param: float  # states per GPU / Ψ, without the gathered unit
    tp: int = 1  # tensor-parallel size: activations split


def hub_or_local_config(name: str, flag: str):
    """The config of a local folder, of the hub cache, or of the hub; a hub the machine cannot reach is one line at
    once (huggingface_hub retried for ~25 s), naming the flag the user gave."""
    from huggingface_hub import constants
    from transformers import AutoConfig

    from common.inputs import from_pretrained_or_fail

    if not os.path.isdir(name):
        try:
            return AutoConfig.from_pretrained(name, local_files_only=True)  # cached: no hub needed
        except (OSError, ValueError):
            pass
        if constants.HF_HUB_OFFLINE:
            fail(f"{flag} {name}: no such folder, and not in the hub cache (HF_HUB_OFFLINE is set): give a folder "
                 "holding its config.json")
        host = urllib.parse.urlparse(constants.ENDPOINT)
        try:
            socket.create_connection((host.hostname, host.port or 443), timeout=3).close()
        except OSError as error:
            fail(f"{flag} {name}: no such folder, not in the hub cache, and {constants.ENDPOINT} cannot be reached "
                 f"({error.strerror or error}): give a folder holding its config.json")
    return from_pretrained_or_fail(AutoConfig.from_pretrained, name, flag)


def model_shape(args: argparse.Namespace) -> ModelShape:
    """Parameter count and shape: from --params, or from a config instantiated on the meta device (no memory)."""
    if args.params:
        return ModelShape(params=int(args.params), largest_unit=0)
    import torch
    from transformers import AutoModelForCausalLM

    from common.inputs.modeling import load_config

    if args.config_name:
        config = hub_or_local_config(args.config_name, getattr(args, "config_flag", "--config_name"))
    else:
        config = load_config(argparse.Namespace(model_name_or_path=None, config_name=None,
                                                model_preset=args.model_preset))
    if args.vocab_size:
        config.vocab_size = args.vocab_size
    if hasattr(config, "vision_config"):
        return vision_language_shape(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return language_model_shape(model, config)


def language_model_shape(model, config) -> ModelShape:
    """A causal LM's shape from its (meta) model; `model` may be a vision-language model, whose language part this
    is (`config` then its text config)."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    units = [sum(p.numel() for p in layer.parameters()) for layer in getattr(decoder, "layers", [])]
    units += [model.get_input_embeddings().weight.numel(), model.get_output_embeddings().weight.numel()]
    linear = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
    # tensor parallelism splits the linear layers and the embeddings; the rest (the norms) is replicated
    split = {id(p) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
             for p in m.parameters(recurse=False)}  # a tied head's weight is the embedding's
    return ModelShape(params=sum(p.numel() for p in model.parameters()), largest_unit=max(units),
                      layers=config.num_hidden_layers, hidden=config.hidden_size,
                      heads=config.num_attention_heads, vocab=config.vocab_size,
                      linear=sum(m.weight.numel() for m in linear),
                      largest_linear=max(m.weight.numel() for m in linear),
                      lora_per_rank=sum(m.in_features + m.out_features for m in linear),
                      intermediate=config.intermediate_size,
                      kv_hidden=config.hidden_size * getattr(config, "num_key_value_heads", config.num_attention_heads)
                      // config.num_attention_heads,
                      replicated=sum(p.numel() for p in model.parameters() if id(p) not in split))


def vision_language_shape(config) -> ModelShape:
    """A vision-language model (scripts/finetune_vlm.py): the language model's shape (its decoder layers, LoRA's
    targets), all parameters counted, and the vision encoder's size apart (common/inputs/vision_models.py's parts)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from common.inputs.vision_models import PROJECTORS, VISION_TOWERS, named_part

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    shape = language_model_shape(model, config.get_text_config())
    shape.params = sum(p.numel() for p in model.parameters())
    tower, projector = named_part(model, VISION_TOWERS)[1], named_part(model, PROJECTORS)
    shape.projector_params = sum(p.numel() for p in projector[1].parameters()) if projector else 0
    shape.vision_params = sum(p.numel() for p in tower.parameters()) - (
        shape.projector_params if projector and projector[0].startswith(named_part(model, VISION_TOWERS)[0]) else 0)
    vision = config.vision_config
    shape.vision_layers = getattr(vision, "num_hidden_layers", None) or getattr(vision, "depth", 0)
    shape.vision_hidden = getattr(vision, "embed_dim", None) or vision.hidden_size
    if getattr(vision, "image_size", None) and getattr(vision, "patch_size", None):
        shape.image_patches = (vision.image_size // vision.patch_size) ** 2 + (
            1 if getattr(vision, "model_type", "").startswith("clip") else 0)  # CLIP's class token
    return shape


# QLoRA: bitsandbytes 0.50's 4-bit matmul is fused in the forward; its backward dequantizes the weight to bf16 for
# the input's gradient, one linear layer at a time
DEQUANTIZED_BYTES = 2
LOGITS_BYTES = 12  # per token per vocabulary entry at the loss's backward: fp32 log-softmax, its gradient, the input's


def logits_bytes(shape: ModelShape, seq: int, batch: int, chunked: bool, trained_head: bool = True,
                 device: str = "cuda") -> float:
    """The logits at the loss's backward, all of them or one chunk (see the docstring)."""
    tokens, v = seq * batch, shape.vocab
    if not chunked:
        return tokens * v * LOGITS_BYTES
    if chunked_loss.OPTIONS is None:  # checkpointed chunks (torch < 2.13): one chunk as the unchunked loss holds it
        return min(tokens, CHUNK_TOKENS) * v * LOGITS_BYTES
    # F.linear_cross_entropy: a chunk's fp32 logits; on a CPU (its "accurate" policy) also an fp32 copy of the head's
    # weight, and three more fp32 buffers of its size when the head is trained (measured); on CUDA (its "compact"
    # policy, torch 2.13's source) no copy of the weight, and a trained head's bf16 gradient of its cast weight
    weight_buffers = (4 * (4 if trained_head else 1) if device == "cpu" else 2 if trained_head else 0)
    return min(tokens, CHUNK_TOKENS) * v * 4 + weight_buffers * v * shape.hidden


def activation_bytes(shape: ModelShape, seq: int, batch: int, checkpointing: bool, sdpa: bool = True,
                     chunked: bool = False, tp: int = 1) -> float:
    """Per-GPU activation memory of one micro-batch, `tp`: tensor-parallel size (see the module docstring)."""
    s, b, h, layers = seq, batch, shape.hidden, shape.layers
    per_layer = s * b * h * (10 + (24 + (0 if sdpa else 5 * shape.heads * s / h)) / tp)
    logits = logits_bytes(shape, seq, batch, chunked)
    if checkpointing:
        return 2 * s * b * h * layers + per_layer + logits
    return layers * per_layer + logits


def per_token_layer_bytes(shape: ModelShape, mode: str, k: int = 2, residual: int = 2, tp: int = 1) -> float:
    """Bytes one token keeps per decoder layer for the backward, by activation-memory mode (module docstring);
    `residual`: bytes of a layer's input (4 when the embeddings are fp32, as in full fine-tuning under autocast)."""
    h, i, kv, layers = shape.hidden, shape.intermediate or 4 * shape.hidden, shape.kv_hidden or shape.hidden, shape.layers
    kept = layer_activation_bytes(shape, residual, tp)
    every_layer = {"none": kept, "full": residual * h, "offload": 0,
                   "op": 2 * (h + 2 * kv + h + h + 2 * i + h)}  # matmul and attention outputs, bf16
    if mode.startswith("every"):
        checkpointed = math.ceil(layers / k)
        return (residual * h * checkpointed + kept * (layers - checkpointed)) / layers
    return every_layer[mode]


def layer_activation_bytes(shape: ModelShape, residual: int = 2, tp: int = 1) -> float:
    """Bytes a Llama decoder layer saves per token for its backward under bf16 autocast, counted op by op: an fp32
    residual stream (fp32 embeddings) has its two RMSNorms save fp32 tensors (16·h) and autocast cast the norms'
    outputs once per projection (q, k, v, gate, up: 10·h), rotary q and k, the attention's output and o's input
    (8·h + 4·kv), the MLP's gate, up, SiLU and product (8·i): 34·h + 4·kv + 8·i; a bf16 stream saves 20·h + 4·kv
    + 8·i (measured on a CPU to 0.3 %, five shapes). Korthikanti's 34·h is a GPT layer's (MLP 4·h wide, no casts).
    Under tensor parallelism over `tp` GPUs the heads-wide (8·h + 4·kv) and MLP-wide (8·i) ones are split, the
    hidden-wide ones (norms and their casts) whole."""
    h, i, kv = shape.hidden, shape.intermediate or 4 * shape.hidden, shape.kv_hidden or shape.hidden
    return (26 if residual == 4 else 12) * h + (8 * h + 4 * kv + 8 * i) / tp


@dataclass
class Run:
    """One training run on one GPU holding the whole model (one GPU; DDP adds its gradient buckets), bf16 autocast."""
    method: str = "full fine-tuning"  # or "LoRA", "QLoRA" (adapter_options' names)
    seq: int = 2048
    batch: int = 1  # rows per micro-batch (DPO: 2 per pair, chosen and rejected in one forward)
    mode: str = "none"  # activation memory: none, every (k-th layer), op, full (checkpointing), offload
    chunked: bool = False
    optimizer_bytes: float = 8  # AdamW's m and v per trained parameter; 2 with --optim adamw_8bit
    lora_r: int = 16
    nested: bool = False
    lora_dropout: bool = True  # --lora_dropout > 0: each adapter keeps its own dropped-out input and mask
    device: str = "cuda"  # where it runs: a CPU's kernels keep what a GPU's do not (chunked loss, offloading)
    every: int = 2  # --selective_ac_option k: every k-th layer checkpointed
    reference_bytes: float = 0  # DPO's live reference: a frozen fp32 copy of the model
    ddp_buckets: bool = False  # DDP over several processes: a second fp32 copy of the gradients
    tp: int = 1  # tensor-parallel size: the heads- and MLP-wide activations split, the head's weight too
    frozen: int = 0  # parameters a full fine-tuning leaves untrained (finetune_vlm.py's --freeze_vision_tower/...)
    vision_tokens: int = 0  # the vision encoder's tokens per micro-batch when it trains (it keeps nothing if not)


# peak_memory's parts that are model states, not activations
MODEL_STATES = ("weights", "reference model", "optimizer states", "gradients", "casts", "dequantized weight")


def adapter_input_bytes(shape: ModelShape, run: Run) -> float:
    """Bytes per token an adapted layer saves beyond the base layer's: with dropout each adapter keeps its own
    dropped-out bf16 input and its mask (3 bytes per input feature; q, k, v, o, gate, up: h wide, down: i wide);
    without dropout the adapter's input is the layer's own tensor. peft's fp32 copy of the input is gone under
    autocast (common/features/lora.py keep_adapter_inputs_16bit)."""
    if run.method == "full fine-tuning" or not run.lora_dropout:
        return 0
    return 3 * (6 * shape.hidden + (shape.intermediate or 4 * shape.hidden))


def peak_memory(shape: ModelShape, run: Run) -> dict[str, float]:
    """Bytes alive at a training step's peak, by category, and "total" (their sum): the GPU suite's memory rows,
    this tool's per-run tables and its answer for one command print this. The peak is the larger of two moments,
    measured on a CPU with torch's memory profiler (docs/configs-and-memory.md): the loss's backward (the logits;
    no gradient yet, zero_grad left them None) and a decoder layer's backward (the gradients; one layer's
    activations while it is recomputed)."""
    tokens, h, v = run.seq * run.batch, shape.hidden, shape.vocab
    _, _, base, trained = next(o for o in adapter_options(shape, run.lora_r, run.nested) if o[0] == run.method)
    full = run.method == "full fine-tuning"
    trained_params = trained / 16 if not full else shape.params - run.frozen
    residual = 4 if full else 2  # fp32 embeddings make the residual stream fp32; a bf16 base keeps it bf16
    adapter_inputs = adapter_input_bytes(shape, run)
    uncheckpointed = {"none": shape.layers, "op": shape.layers,
                      "every": shape.layers - math.ceil(shape.layers / run.every)}.get(run.mode, 0)
    # offloading moves what a layer saves to host memory; on a CPU it is host memory already, nothing moves
    mode = "full" if run.mode == "offload" and run.device == "cpu" else run.mode
    dequantized = DEQUANTIZED_BYTES * shape.largest_linear if run.method == "QLoRA" else 0
    states = {"weights": 4 * shape.params if full else base - dequantized + 4 * trained_params,
              "reference model": run.reference_bytes,
              "optimizer states": run.optimizer_bytes * trained_params,
              "activations kept": tokens * shape.layers
              * per_token_layer_bytes(shape, mode, run.every, residual, run.tp)
              + tokens * uncheckpointed * adapter_inputs,
              # a trained vision encoder: a layer's input (fp32) each when checkpointed, else Korthikanti's 34·h
              "vision activations kept": run.vision_tokens * shape.vision_layers * shape.vision_hidden
              * (4 if run.mode != "none" else 34),
              "casts": 2 * shape.params if full and run.mode == "none" else 0}  # autocast's bf16 weights, kept
    recomputed = 0 if run.mode == "none" else tokens * (layer_activation_bytes(shape, residual, run.tp)
                                                         + adapter_inputs)
    loss = {"logits": logits_bytes(shape, run.seq, run.batch, run.chunked, full, run.device),  # gathered: whole
            "head input and casts": 2 * 4 * tokens * h + (2 * v * h / run.tp if full and run.mode != "none" else 0)}
    # an adapted layer's backward also holds the gradient of its output and of the residual (bf16) and one MLP-wide
    # bf16 temporary of the op at work (measured at hidden 1,024, MLP 3,584; full fine-tuning's are within its count)
    working = 0 if full else tokens * (4 * h + 2 * (shape.intermediate or 4 * h))
    layer = {"gradients": 4 * trained_params * (2 if run.ddp_buckets else 1), "layer recomputed": recomputed,
             "layer's backward working set": working,
             "dequantized weight": dequantized}
    moment = max((loss, layer), key=lambda m: sum(m.values()))
    result = {k: b for k, b in {**states, **moment}.items() if b}
    return {**result, "total": sum(result.values())}


AUTOCAST_CASTS = 2  # bytes per parameter: autocast's bf16 weight copies, kept for the backward without checkpointing
PLAIN_PYTORCH = ("single_gpu.yaml", "multi_gpu.yaml", "multi_node.yaml")  # autocast: the rows whose states count them


def peak_activations(shape: ModelShape, args: argparse.Namespace, mode: str, sdpa: bool = True, tp: int = 1) -> float:
    """What one micro-batch adds to a full fine-tuning's model states at its peak (`peak_memory`, the figures of
    --activation_modes and of one command): the activations kept and recomputed, the logits or a layer's gradients,
    whichever moment is larger; model states = fp32 weights, gradients, AdamW m and v, and without checkpointing
    autocast's bf16 weights. Eager attention adds its s x s scores (5·a·s bytes per token, every layer or the one
    recomputed)."""
    run = Run("full fine-tuning", args.seq_len, args.micro_batch_size, mode, chunked=args.chunked_cross_entropy, tp=tp)
    peak = peak_memory(shape, run)
    states = peak["weights"] + peak["optimizer states"] + 4 * shape.params + peak.get("casts", 0)
    tokens, layers = args.seq_len * args.micro_batch_size, shape.layers if mode == "none" else 1
    scores = 0 if sdpa else tokens * 5 * shape.heads * args.seq_len / tp * layers
    return peak["total"] - states + scores


def activation_modes_report(args: argparse.Namespace, shape: ModelShape, states: float, what: str) -> list[str]:
    """Per mode: what a token keeps per layer, the activations at --seq_len, and the longest sequence that fits."""
    b, limit = args.micro_batch_size, HEADROOM * args.gpu_memory_gb * GB
    host_limit = HEADROOM * args.host_memory_gb * GB if args.host_memory_gb else math.inf
    held = (f"{states / GB:.1f} GB on one GPU without checkpointing, "
            f"{(states - AUTOCAST_CASTS * shape.params) / GB:.1f} GB with it" if what == "full fine-tuning"
            else f"{states / GB:.1f} GB on one GPU")
    lines = ["", f"Activation memory by mode ({what}, model states {held}, micro-batch {b}, "
             "SDPA, one chunk of the logits with --chunked_cross_entropy):", "",
             "| mode | flags | bytes per token per layer | GPU total at --seq_len | longest sequence that fits |",
             "|---|---|---|---|---|"]
    modes = [("none", ""), ("every 2nd layer", "--selective_ac_option 2"), ("per op", "--selective_ac_option op"),
             ("full", "--gradient_checkpointing"), ("offload", "--gradient_checkpointing --activation_offloading")]
    for name, flags in modes:
        key = {"every 2nd layer": "every", "per op": "op"}.get(name, name)
        residual = 4 if what == "full fine-tuning" else 2
        per = per_token_layer_bytes(shape, key, residual=residual)

        def total(seq: int) -> float:
            return peak_memory(shape, Run(what, seq, b, key, chunked=True, lora_r=args.lora_r,
                                          nested=args.use_bnb_nested_quant))["total"]

        # offload moves what full checkpointing keeps (each layer's bf16 input) to host RAM, which bounds it too
        host_per_token = b * per_token_layer_bytes(shape, "full") * shape.layers if key == "offload" else 0
        longest = 0
        while (total(longest + 1024) <= limit and (longest + 1024) * host_per_token <= host_limit
               and longest < 2**24):
            longest += 1024
        longest_text = f"{longest:,} tokens" if longest else "none (model states alone do not fit)"
        lines.append(f"| {name} | {'`' + flags + '`' if flags else ''} | {per / 1e3:.1f} kB | "
                     f"{total(args.seq_len) / GB:.1f} GB | "
                     f"{longest_text} |")
    bound = "90% of --host_memory_gb" if args.host_memory_gb else "host RAM (give --host_memory_gb to bound it)"
    lines += ["", f"Offload keeps each layer's bf16 input (2·h bytes per token per layer) in host RAM: its longest "
              f"sequence also fits {bound}. "
              "Published for comparison, not measured here: Unsloth, Llama-3.1-8B QLoRA on one 80 GB GPU, 342k tokens "
              "of context (plain Hugging Face + FlashAttention-2: 28k); TRL, 8B with sequence parallelism on 8 x H100, "
              "300k+ tokens."]
    return lines


def options(shape: ModelShape, num_gpus: int, gpus_per_node: int) -> list[Option]:
    """Every launch config with its model-state bytes per GPU and host bytes per node, fastest first."""
    psi, n, g = shape.params, num_gpus, gpus_per_node
    nodes = math.ceil(n / g)
    unit = 4 * shape.largest_unit
    build = 4 * psi * min(g, n)  # each process of a node builds the fp32 model on the CPU first
    ddp = "single_gpu.yaml" if n == 1 else "multi_gpu.yaml" if nodes == 1 else "multi_node.yaml"
    buckets = 0 if n == 1 else 4  # DDP's gradient buckets
    eight_bit = "--optim adamw_8bit"
    # TP talks inside every layer: within one node
    tensor_parallel = [("tp.yaml", f"TP {n}: layers split over the GPUs", n, 1)] if 1 < n <= g else []
    if n >= 4 and n % 2 == 0:
        tensor_parallel.append(("fsdp2_tp.yaml", f"FSDP2 over {n // 2} x TP 2", 2, n // 2))
    table = [
        (ddp, "", "PyTorch AdamW" + (", DDP" if n > 1 else ""), 18 + buckets, 0, build),
        (ddp, eight_bit, "bitsandbytes 8-bit AdamW", 12 + buckets, 0, build),
        ("deepspeed_zero1.yaml", "", "ZeRO-1: optimizer states sharded", 4 + 12 / n, 0, build),
        ("deepspeed_zero2.yaml", "", "ZeRO-2: + gradients sharded", 2 + 14 / n, 0, build),
        ("deepspeed_zero2.yaml", eight_bit, "ZeRO-2, 8-bit AdamW", 2 + 8 / n, 0, build),
        ("fsdp2.yaml", "", "FSDP2 full shard", 16 / n, unit, 4 * psi),
        ("deepspeed_zero3.yaml", "", "ZeRO-3: + weights sharded", 16 / n, unit, 0),
        *[(config, "", what, 16 * tp_held(shape, tp) / (dp * psi), unit / tp, build)
          for config, what, tp, dp in tensor_parallel],
        ("deepspeed_zero2_offload.yaml", "", "ZeRO-2, optimizer on CPU", 2 + 2 / n, 0, max(build, 16 * psi / nodes)),
        ("deepspeed_zero3_offload.yaml", "", "ZeRO-3, optimizer + weights on CPU", 0, unit, 18 * psi / nodes),
    ]
    tp_sizes = {config: tp for config, _, tp, _ in tensor_parallel}
    return [Option(config, flags, what, per_param * psi + gathered, host, per_param, tp_sizes.get(config, 1))
            for config, flags, what, per_param, gathered, host in table]


def tp_held(shape: ModelShape, tp: int) -> float:
    """Parameters one process of a tensor-parallel group holds: the replicated ones (norms), a 1/tp share of the rest
    (common/features/tensor_parallel.py's plan)."""
    return shape.replicated + (shape.params - shape.replicated) / tp


# Published, not measured here: torchtune's README ("Memory and training speed"), Llama-3.1-8B on one RTX 4090,
# batch 2, packed to 2,048 tokens, compile on.
# The README's 8B commands beyond `--bf16 --gradient_checkpointing --max_seq_length 2048
# --per_device_train_batch_size 2` (docs/lora.md says what each saves): rank 8 and no dropout on the adapters' inputs
# (torchtune's Llama-3.1 configs' dropout), the checkpointed layers' inputs in host memory, the loss over chunks,
# AdamW's states in 8 bits; QLoRA's 4-bit scales quantized too.
RECOMMENDED_8B = {
    "LoRA": ["--use_peft", "--lora_r", "8", "--lora_dropout", "0", "--activation_offloading",
             "--chunked_cross_entropy", "--optim", "adamw_8bit"],
    "QLoRA": ["--use_peft", "--load_in_4bit", "--use_bnb_nested_quant", "--lora_r", "8", "--lora_dropout", "0",
              "--activation_offloading", "--chunked_cross_entropy", "--optim", "adamw_8bit"],
}
PUBLISHED_8B = {"QLoRA": "7.4 GiB at 2,413 tokens/s", "LoRA": "16.2 GiB at 3,083 tokens/s"}


def adapter_options(shape: ModelShape, r: int, nested: bool) -> list[tuple[str, str, float, float]]:
    """(method, flags, frozen base bytes, trained bytes) for full fine-tuning, LoRA and QLoRA on one GPU."""
    adapter = 16 * r * shape.lora_per_rank  # fp32 weights, gradients, AdamW m and v
    scales = 1 / 64 + 4 / (64 * 256) if nested else 4 / 64
    rest = shape.params - shape.linear
    qlora_base = shape.linear * (0.5 + scales) + 2 * rest + DEQUANTIZED_BYTES * shape.largest_linear  # + one layer
    return [("full fine-tuning", "", 0, 18 * shape.params),
            ("LoRA", "--use_peft --bf16", 2 * shape.params, adapter),
            ("QLoRA", "--use_peft --load_in_4bit --bf16" + (" --use_bnb_nested_quant" if nested else ""),
             qlora_base, adapter)]


def adapter_report(args: argparse.Namespace, shape: ModelShape) -> list[str]:
    """The --use_peft table: full fine-tuning vs LoRA vs QLoRA, per GPU holding the whole model (one GPU, DDP); each
    row's states and activations are `peak_memory`'s parts at the peak, so they add up to its total."""
    adapter_params = args.lora_r * shape.lora_per_rank
    lines = ["", f"LoRA rank {args.lora_r} on every linear layer but the head ({adapter_params / 1e6:.1f}M adapter "
             "parameters), per GPU holding the whole model (one GPU, DDP):", "",
             "| method | flags | model states at the peak (plain / checkpointed) "
             "| activations and logits at the peak (plain / checkpointed) "
             "| GPU total (plain / checkpointed) | fits |", "|---|---|---|---|---|---|"]
    for method, flags, _, _ in adapter_options(shape, args.lora_r, args.use_bnb_nested_quant):
        peaks = [peak_memory(shape, Run(method, args.seq_len, args.micro_batch_size, mode, args.chunked_cross_entropy,
                                        lora_r=args.lora_r, nested=args.use_bnb_nested_quant))
                 for mode in ("none", "full")]
        totals = [peak["total"] for peak in peaks]
        states = [sum(peak.get(k, 0) for k in MODEL_STATES) for peak in peaks]
        verdict = "yes" if fits(totals[0], args.gpu_memory_gb * GB) else "with `--gradient_checkpointing`" if fits(
            totals[1], args.gpu_memory_gb * GB) else "no"
        lines.append(f"| {method} | {'`' + flags + '`' if flags else ''} | {states[0] / GB:.2f} / {states[1] / GB:.2f} "
                     f"GB | {(totals[0] - states[0]) / GB:.2f} / {(totals[1] - states[1]) / GB:.2f} GB | "
                     f"{totals[0] / GB:.2f} / {totals[1] / GB:.2f} GB ({totals[1] / 2**30:.1f} GiB checkpointed) "
                     f"| {verdict} |")
    lines += ["", "Published for comparison, not measured here (torchtune, Llama-3.1-8B, one RTX 4090, batch 2, "
              "packed 2,048 tokens, compile on): " + "; ".join(f"{k} {v}" for k, v in PUBLISHED_8B.items())
              + ". This estimate counts "
              + ("one chunk of the logits (--chunked_cross_entropy)." if args.chunked_cross_entropy else
                 "the full logits (12 bytes per token per vocabulary entry); add --chunked_cross_entropy to count "
                 "one chunk.") + " For one exact command: `python tools/estimate_memory.py -- scripts/<recipe>.py "
              "<its flags>`."]
    return lines


def dpo_report(args: argparse.Namespace, shape: ModelShape) -> list[str]:
    """The --dpo table: policy + reference per GPU holding both whole (one GPU, DDP), 2 x micro-batch rows."""
    rows = 2 * args.micro_batch_size
    pairs = argparse.Namespace(**{**vars(args), "micro_batch_size": rows})  # the main table's figures at 2b rows
    acts = [peak_activations(shape, pairs, mode, args.attn_implementation != "eager") for mode in ("none", "full")]
    reference_logits = args.seq_len * args.micro_batch_size * 2 * shape.vocab * 6  # bf16 logits + their fp32 copy
    methods = adapter_options(shape, args.lora_r, args.use_bnb_nested_quant)
    table = [("full, live reference", "", methods[0][3], 4 * shape.params + reference_logits),
             ("full, precomputed reference", "`--precompute_ref_log_probs`", methods[0][3], 0),
             ("LoRA (reference: adapter disabled)", f"`{methods[1][1]}`", methods[1][2] + methods[1][3], 0),
             ("QLoRA (reference: adapter disabled)", f"`{methods[2][1]}`", methods[2][2] + methods[2][3], 0)]
    lines = ["", f"DPO, {args.micro_batch_size} pairs per micro-batch ({rows} rows), per GPU holding the policy and "
             "the reference whole (one GPU, DDP):", "",
             "| method | flags | policy states (plain / checkpointed) | reference | activations (plain / checkpointed) "
             "| GPU total (plain / checkpointed) | fits |", "|---|---|---|---|---|---|---|"]
    for method, flags, policy, reference in table:
        casts = AUTOCAST_CASTS * shape.params if method.startswith("full") else 0  # kept without checkpointing only
        totals = [policy + reference + acts[0], policy - casts + reference + acts[1]]
        verdict = "yes" if fits(totals[0], args.gpu_memory_gb * GB) else "with `--gradient_checkpointing`" if fits(
            totals[1], args.gpu_memory_gb * GB) else "no"
        held = f"{policy / GB:.1f} / {(policy - casts) / GB:.1f} GB" if casts else f"{policy / GB:.1f} GB"
        lines.append(f"| {method} | {flags} | {held} | {reference / GB:.1f} GB | {acts[0] / GB:.1f} / "
                     f"{acts[1] / GB:.1f} GB | {totals[0] / GB:.1f} / {totals[1] / GB:.1f} GB | {verdict} |")
    return lines


def fits(total: float | None, limit: float) -> bool:
    return total is not None and total <= HEADROOM * limit


def report(args: argparse.Namespace) -> str:
    shape = model_shape(args)
    gpus_per_node = args.gpus_per_node or min(args.num_gpus, 8)
    gpu_limit, host_limit = args.gpu_memory_gb * GB, (args.host_memory_gb or math.inf) * GB
    sdpa = args.attn_implementation != "eager"
    def activations(tp: int) -> list[float] | None:  # plain / checkpointed; tensor parallelism splits some
        return None if shape.hidden is None else [peak_activations(shape, args, mode, sdpa, tp)
                                                  for mode in ("none", "full")]

    acts = activations(1)
    source = f"--params {args.params:.3g}" if args.params else (args.config_name or f"preset {args.model_preset}")
    lines = [f"Model: {source}, {shape.params / 1e9:.3g}B parameters; {args.num_gpus} GPU(s) of "
             f"{args.gpu_memory_gb:g} GB ({gpus_per_node} per node)"
             + (f", {args.host_memory_gb:g} GB host RAM per node" if args.host_memory_gb else "")
             + (f"; micro-batch {args.micro_batch_size} x {args.seq_len} tokens, {args.attn_implementation}"
                if acts else "; activations not included (give --model_preset or --config_name)"),
             ""]
    if acts:
        tokens = args.seq_len * args.micro_batch_size
        full, chunked = (logits_bytes(shape, args.seq_len, args.micro_batch_size, c) for c in (False, True))
        chunk = min(tokens, CHUNK_TOKENS) * shape.vocab * (4 if chunked_loss.OPTIONS is not None else LOGITS_BYTES)
        lines += [f"Logits (vocabulary {shape.vocab:,}) at the loss's backward, per micro-batch: {full / GB:.2f} GB "
                  f"in full; with --chunked_cross_entropy {chunk / GB:.3f} GB for one chunk of "
                  f"{min(tokens, CHUNK_TOKENS):,} tokens" + (f", plus {(chunked - chunk) / GB:.2f} GB of buffers of "
                                                             "the trained head's weight" if chunked > chunk else "")
                  + f"; the table counts {'one chunk' if args.chunked_cross_entropy else 'them in full'}.", ""]
    lines += ["| config | what | model states, bytes/param per GPU (plain / checkpointed) | model states per GPU | "
              "activations per GPU (plain / checkpointed) | GPU total (plain / checkpointed) | host RAM per node "
              "| fits |",
              "|---|---|---|---|---|---|---|---|"]
    candidates = []  # (rank, option, needs checkpointing): offload is slower than recomputing activations
    for index, opt in enumerate(options(shape, args.num_gpus, gpus_per_node)):
        row_acts = activations(opt.tp)
        # plain PyTorch's 18 bytes count autocast's bf16 weights, which only a run without checkpointing keeps
        casts = AUTOCAST_CASTS * shape.params if opt.config in PLAIN_PYTORCH else 0
        states = [opt.states, opt.states - casts]
        totals = [st + a for st, a in zip(states, row_acts)] if row_acts else [opt.states, None]
        host_ok = opt.host <= HEADROOM * host_limit
        verdict = ("yes" if fits(totals[0], gpu_limit) else
                   "with `--gradient_checkpointing`" if fits(totals[1], gpu_limit) else "no")
        if verdict != "no" and not host_ok:
            verdict = "no (host RAM)"
        if verdict in ("yes", "with `--gradient_checkpointing`"):
            candidates.append(((("offload" in opt.config), verdict != "yes", index), opt, verdict != "yes"))
        act = f"{row_acts[0] / GB:.1f} / {row_acts[1] / GB:.1f} GB" if row_acts else "n/a"
        total = (f"{totals[0] / GB:.1f} / {totals[1] / GB:.1f} GB" if row_acts
                 else f"{totals[0] / GB:.1f} GB + activations")
        name = opt.config + (f" + `{opt.flags}`" if opt.flags else "")
        per_param, held = f"{opt.bytes_per_param:.3g}", f"{opt.states / GB:.1f} GB"
        if casts and row_acts:
            per_param += f" / {opt.bytes_per_param - AUTOCAST_CASTS:.3g}"
            held = f"{states[0] / GB:.1f} / {states[1] / GB:.1f} GB"
        lines.append(f"| {name} | {opt.what} | {per_param} | {held} | {act} | "
                     f"{total} | {opt.host / GB:.1f} GB | {verdict} |")
    lines.append("")
    if not candidates:
        lines.append("Nothing fits: add GPUs, shorten --seq_len / --micro_batch_size, or use "
                     "deepspeed_zero3_nvme_offload.yaml.")
    else:
        _, best, checkpointing = min(candidates, key=lambda c: c[0])
        bf16 = "--bf16" if best.config.startswith("deepspeed_") else ""  # their YAMLs leave precision to the flags
        flags = " ".join(f for f in (bf16, best.flags, "--gradient_checkpointing" if checkpointing else "") if f)
        lines.append(f"Fastest that fits: `accelerate launch --config_file accelerate_configs/{best.config} "
                     f"scripts/pretrain_llama.py{' ' + flags if flags else ''}`"
                     + ("." if acts else " (model states only: activations come on top)."))
    if args.use_peft:
        lines += adapter_report(args, shape)
    if args.dpo:
        lines += dpo_report(args, shape)
    if args.activation_modes and acts:
        method, _, base, trained = adapter_options(shape, args.lora_r, args.use_bnb_nested_quant)[
            2 if args.use_peft else 0]
        lines += activation_modes_report(args, shape, base + trained, method)
    return "\n".join(lines)


RECIPES = ("pretrain_llama.py", "finetune_causal_lm.py", "finetune_dpo.py",  # the causal LMs: a Llama-like layer
           "finetune_vlm.py")  # a Llama-like language model, and a vision encoder
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


def recipe_flags(argv: list[str], recipe: str = "") -> argparse.Namespace:
    """The flags of a recipe's command line that decide its memory, parsed with the recipes' own flag definitions
    (common/flags.py and the features') and the recipe's own defaults; the others (data, logging, ...) are left
    aside."""
    from common.features.activation_memory import add_activation_memory_args
    from common.features.chunked_loss import add_chunked_loss_args
    from common.features.liger import add_liger_args
    from common.features.lora import add_peft_args
    from common.features.muon import add_muon_args
    from common.flags import add_model_args, add_training_args
    from common.inputs.modeling import add_finetuning_args

    parser = ArgumentParser(add_help=False)
    add_model_args(parser, PRESETS)
    add_training_args(parser)
    add_activation_memory_args(parser)
    add_finetuning_args(parser)
    add_chunked_loss_args(parser)
    add_liger_args(parser)
    add_peft_args(parser)
    add_muon_args(parser)  # pretrain_llama.py's --optim muon
    parser.add_argument("--block_size", type=int, default=256)  # pretrain_llama.py's
    parser.add_argument("--tokenizer_vocab_size", type=int, default=8192)  # pretrain_llama.py's trained tokenizer
    parser.add_argument("--precompute_ref_log_probs", action="store_true")  # finetune_dpo.py's
    parser.add_argument("--keep_dropout", action="store_true")  # finetune_dpo.py's: dropout is off without it
    parser.add_argument("--freeze_vision_tower", action="store_true")  # finetune_vlm.py's
    parser.add_argument("--freeze_projector", action="store_true")  # finetune_vlm.py's
    if recipe == "pretrain_llama.py":
        parser.set_defaults(optim="muon")  # its default optimizer
    return parser.parse_known_args(argv)[0]


def launch_settings(command: list[str]) -> tuple[list[str], dict]:
    """`[accelerate launch [--config_file F] [--num_processes N] ...] scripts/<recipe>.py <flags>` -> (the recipe
    and its flags, {"config": the YAML's settings, "num_processes": N, "tp": its tensor-parallel size})."""
    import yaml

    launch, settings = {}, {}
    if command[:2] == ["accelerate", "launch"]:
        command = command[2:]
        while command and command[0].startswith("--"):
            following = command[1] if len(command) > 1 else "--"
            takes_value = not (following.startswith("--") or following.endswith(".py"))  # --quiet takes none
            launch[command[0][2:]] = following if takes_value else ""
            command = command[1 + takes_value:]
    if "config_file" in launch:
        if not os.path.isfile(launch["config_file"]):
            fail(f"--config_file {launch['config_file']}: no such file")
        with open(launch["config_file"], encoding="utf-8") as f:
            settings = yaml.safe_load(f) or {}
        settings["file"] = os.path.basename(launch["config_file"])
    processes = int(launch.get("num_processes") or settings.get("num_processes") or 1)
    if settings.get("distributed_type", "NO") == "NO":
        processes = 1
    tp = int((settings.get("parallelism_config") or {}).get("parallelism_config_tp_size", 1))
    if processes % tp:
        fail(f"{settings.get('file')}: tp_size {tp} does not divide the {processes} processes")
    return command, {"config": settings, "num_processes": processes, "tp": tp}


def command_run(command: list[str], device: str = "cuda", images_per_row: int = 1,
                image_patches: int | None = None) -> tuple[ModelShape, Run, dict]:
    """The model shape, the Run and a description of the exact command after `--` (see `command_answer`)."""
    command, launch = launch_settings(command)
    if not command or os.path.basename(command[0]) not in RECIPES:
        fail(f"after -- give the recipe and its flags: one of {', '.join('scripts/' + r for r in RECIPES)} "
             f"(got {command[0] if command else 'nothing'})")
    recipe = os.path.basename(command[0])
    args = recipe_flags(command[1:], recipe)
    precision = args.mixed_precision or launch["config"].get("mixed_precision")
    if precision not in ("bf16", "fp16"):
        fail("the estimate is for 16-bit mixed precision: add --bf16 (or --fp16) to the recipe's flags")
    seq = args.block_size if recipe == "pretrain_llama.py" else args.max_seq_length
    if seq is None:
        fail(f"{recipe}: give --max_seq_length; the estimate needs the sequence length")
    source = args.model_name_or_path or args.config_name
    if source is None and recipe != "pretrain_llama.py":
        fail(f"{recipe}: give --model_name_or_path (a folder holding only config.json is enough)")
    shape = model_shape(argparse.Namespace(params=None, config_name=source, model_preset=args.model_preset or (
        None if source else "tiny"), vocab_size=None if source else args.tokenizer_vocab_size,
        config_flag="--model_name_or_path" if args.model_name_or_path else "--config_name"))
    method = "full fine-tuning" if not args.use_peft else "QLoRA" if args.load_in_4bit else "LoRA"
    option = args.selective_ac_option
    mode = ("offload" if args.activation_offloading else "op" if option == "op" else "every" if option
            else "full" if args.gradient_checkpointing else "none")
    dpo = recipe == "finetune_dpo.py"
    live_reference = dpo and method == "full fine-tuning" and not args.precompute_ref_log_probs
    run = Run(method, seq, args.per_device_train_batch_size * (2 if dpo else 1), mode,
              args.chunked_cross_entropy or args.use_liger_kernel, optimizer_bytes(shape, args.optim),
              args.lora_r, args.use_bnb_nested_quant, args.lora_dropout > 0 and (args.keep_dropout or not dpo), device,
              int(option) if option and option.isdigit() else 2, 4 * shape.params if live_reference else 0,
              launch["num_processes"] > 1 and launch["tp"] == 1, launch["tp"])
    if shape.vision_layers:  # finetune_vlm.py: --max_seq_length counts the image tokens; the encoder's come apart
        run.frozen = shape.vision_params * args.freeze_vision_tower + shape.projector_params * args.freeze_projector
        patches = image_patches or shape.image_patches
        if patches is None:
            fail(f"{source}: its vision encoder's tokens per image depend on the image's size: give --image_patches")
        if method == "full fine-tuning" and not args.freeze_vision_tower:
            run.vision_tokens = patches * images_per_row * args.per_device_train_batch_size
    return shape, run, {"recipe": recipe, "model": source or f"preset {args.model_preset or 'tiny'}",
                        "launch": launch, "optim": args.optim}


def optimizer_bytes(shape: ModelShape, optim: str) -> float:
    """Optimizer state per trained parameter: AdamW's m and v (8; 2 in 8 bits); --optim muon keeps one fp32 momentum
    buffer (4) for the hidden matrices (`shape.linear`: all linear layers but the head) and AdamW's 8 for the rest."""
    if optim in EIGHT_BIT:
        return 2
    return 8 - 4 * (shape.linear or 0) / shape.params if optim == "muon" else 8


def engine_states(shape: ModelShape, run: Run, launch: dict, optim: str) -> tuple[str, float] | None:
    """Per-GPU model states under a sharding config (ZeRO, FSDP2: the options table's bytes); None for one GPU or
    DDP, where `peak_memory` counts them itself."""
    name, n, tp = launch["config"].get("file", ""), launch["num_processes"], launch["tp"]
    if tp > 1:
        if run.method != "full fine-tuning":
            fail(f"{name}: {run.method} (--use_peft) is not supported with tensor parallelism (tp_size {tp}); the "
                 "recipes refuse it too")
        held = 16 * tp_held(shape, tp) / (n // tp) + 4 * shape.largest_unit / tp - (
            4 * (shape.linear or 0) / n if optim == "muon" else 0)  # Muon: one momentum buffer, not AdamW's two
        return f"model states (TP {tp}" + (f", FSDP2 over {n // tp}" if n > tp else "") + f", {n} GPUs)", held
    if launch["config"].get("distributed_type", "NO") in ("NO", "MULTI_GPU", "MULTI_CPU"):
        return None
    if run.method != "full fine-tuning":
        fail(f"{name}: the estimate for --use_peft covers one GPU and DDP (each GPU holding the whole base)")
    flags = "--optim adamw_8bit" if optim in EIGHT_BIT else ""
    rows = [o for o in options(shape, launch["num_processes"], min(launch["num_processes"], 8)) if o.config == name]
    if not rows:
        fail(f"{name}: not a config of accelerate_configs/ the estimate knows")
    option = next((o for o in rows if o.flags == flags), rows[0])
    # --optim muon: its matrices' second moment is not kept; that state is sharded over the processes (on the GPU
    # unless the optimizer is offloaded)
    saved = 4 * (shape.linear or 0) / launch["num_processes"] if optim == "muon" and "offload" not in name else 0
    return f"model states ({option.what}, {launch['num_processes']} GPUs)", option.states - saved


def command_answer(command: list[str], gpu_memory_gb: float, device: str = "cuda", images_per_row: int = 1,
                   image_patches: int | None = None) -> dict:
    """One answer for the exact command: the peak per GPU, the parts it is made of (they add up to it), where it
    happens and whether it fits a GPU of `gpu_memory_gb` (finetune_vlm.py: rows of `images_per_row` images, each
    `image_patches` tokens in the vision encoder, by default its config's)."""
    shape, run, about = command_run(command, device, images_per_row, image_patches)
    parts = {k: v for k, v in peak_memory(shape, run).items() if k != "total"}
    sharded = engine_states(shape, run, about["launch"], about["optim"])
    if sharded:
        parts = {sharded[0]: sharded[1], **{k: v for k, v in parts.items() if k not in MODEL_STATES}}
    total = sum(parts.values())
    moment = "the loss's backward" if "logits" in parts else "a decoder layer's backward"
    return {"peak_bytes": round(total), "parts": {k: round(v) for k, v in parts.items()}, "at": moment,
            "gpu_memory_bytes": round(gpu_memory_gb * GB), "usable_bytes": round(HEADROOM * gpu_memory_gb * GB),
            "fits": fits(total, gpu_memory_gb * GB), "recipe": about["recipe"], "model": about["model"],
            "parameters": shape.params, "method": run.method, "tokens_per_micro_batch": run.seq * run.batch,
            "activation_memory": run.mode, "chunked_loss": run.chunked,
            "processes": about["launch"]["num_processes"], "device": device}


def command_report(answer: dict) -> str:
    """`command_answer` as text: the peak, its parts, the verdict (no line contradicts another: the parts are the
    peak's own and add up to it)."""
    gib = 2**30
    lines = [f"{answer['recipe']}, {answer['model']} ({answer['parameters'] / 1e9:.3g}B parameters), "
             f"{answer['method']}, {answer['tokens_per_micro_batch']:,} tokens per micro-batch, activation memory "
             f"{answer['activation_memory']}, {'chunked' if answer['chunked_loss'] else 'full'} logits, "
             f"{answer['processes']} process(es), on {'a GPU' if answer['device'] == 'cuda' else 'a CPU'} "
             f"({'--device cpu for a CPU run: its kernels keep more' if answer['device'] == 'cuda' else '--device cpu'})",
             f"Peak per GPU: {answer['peak_bytes'] / gib:.2f} GiB ({answer['peak_bytes'] / GB:.2f} GB), at "
             f"{answer['at']}; made of:"]
    width = max(len(k) for k in answer["parts"])
    lines += [f"  {k:{width}s} {v / gib:8.3f} GiB" for k, v in answer["parts"].items()]
    lines += [f"  {'total':{width}s} {answer['peak_bytes'] / gib:8.3f} GiB",
              f"Fits a {answer['gpu_memory_bytes'] / GB:g} GB GPU (90 % of it usable, "
              f"{answer['usable_bytes'] / GB:.1f} GB): {'yes' if answer['fits'] else 'no'}. An estimate: check "
              "peak_memory_bytes in metrics.jsonl after a few steps."]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """The table view, or with `-- <command>` one answer for that command (`--json`: as one JSON object)."""
    if "--" not in argv:
        print(report(parse_args(argv)))
        return
    ours, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = ArgumentParser(description="The peak memory per GPU of one exact command.")
    parser.add_argument("--gpu_memory_gb", type=float, default=80, help="Memory of one GPU, for the verdict.")
    parser.add_argument("--json", action="store_true", help="Print the answer as one JSON object (peak_bytes, ...).")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="Where the run computes: a GPU (cuda), or a CPU, whose kernels keep other buffers (the "
                             "tests compare a CPU's profiled peak with this).")
    parser.add_argument("--images_per_row", type=int, default=1,
                        help="scripts/finetune_vlm.py: images in a row (the vision encoder's tokens grow with them).")
    parser.add_argument("--image_patches", type=int,
                        help="scripts/finetune_vlm.py: the vision encoder's tokens per image (default: from its "
                             "config's image_size and patch_size; needed where they vary, as in Qwen2-VL).")
    args = parser.parse_args(ours)
    if not (math.isfinite(args.gpu_memory_gb) and args.gpu_memory_gb > 0):
        fail(f"--gpu_memory_gb must be a finite number > 0 (got {args.gpu_memory_gb})")
    answer = command_answer(command, args.gpu_memory_gb, args.device, args.images_per_row, args.image_patches)
    print(json.dumps(answer) if args.json else command_report(answer))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--params", type=float, help="Parameter count, e.g. 7e9 (activations then left out).")
    model.add_argument("--model_preset", choices=PRESETS, help="A preset of scripts/pretrain_llama.py.")
    model.add_argument("--config_name", help="A model config (local path or hub id).")
    parser.add_argument("--vocab_size", type=int, help="Override the config's vocabulary size.")
    parser.add_argument("--num_gpus", type=int, default=1, help="GPUs in all.")
    parser.add_argument("--gpus_per_node", type=int, help="Default: num_gpus, at most 8.")
    parser.add_argument("--gpu_memory_gb", type=float, default=80, help="Memory of one GPU.")
    parser.add_argument("--host_memory_gb", type=float, help="Host RAM per node; default: not checked.")
    parser.add_argument("--seq_len", type=int, default=2048, help="Tokens per sequence (--block_size).")
    parser.add_argument("--micro_batch_size", type=int, default=1, help="--per_device_train_batch_size.")
    parser.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"),
                        help="Attention kernel (eager stores the attention scores).")
    parser.add_argument("--chunked_cross_entropy", action="store_true",
                        help="Count one chunk of the logits, as the scripts' --chunked_cross_entropy keeps them.")
    parser.add_argument("--activation_modes", action="store_true",
                        help="Add a table: activations and the longest sequence per activation-memory mode (full "
                             "fine-tuning on one GPU, or QLoRA with --use_peft).")
    parser.add_argument("--dpo", action="store_true",
                        help="Add a table: DPO (scripts/finetune_dpo.py) with its live, precomputed or LoRA reference.")
    peft = parser.add_argument_group("LoRA / QLoRA (adds a table: full fine-tuning vs LoRA vs QLoRA)")
    peft.add_argument("--use_peft", action="store_true", help="Also estimate LoRA and QLoRA fine-tuning.")
    peft.add_argument("--use_bnb_nested_quant", action="store_true", help="QLoRA's scales quantized too.")
    peft.add_argument("--lora_r", type=int, default=16, help="LoRA rank.")
    args = parser.parse_args(argv)
    for name in ("params", "gpu_memory_gb", "host_memory_gb"):  # argparse's float() takes "nan" and "inf"
        if getattr(args, name) is not None and not math.isfinite(getattr(args, name)):
            fail(f"--{name} must be a finite number (got {getattr(args, name)})")
    if not (args.params or args.model_preset or args.config_name):
        fail("give --params, --model_preset or --config_name")
    if (args.use_peft or args.dpo) and args.params:
        fail("--use_peft and --dpo need the model's layers: give --model_preset or --config_name instead of --params")
    if args.lora_r < 1:
        fail(f"--lora_r must be >= 1 (got {args.lora_r})")
    for name in ("num_gpus", "seq_len", "micro_batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1 (got {getattr(args, name)})")
    if args.gpus_per_node is not None and not 1 <= args.gpus_per_node <= args.num_gpus:
        fail(f"--gpus_per_node must be between 1 and --num_gpus ({args.num_gpus})")
    if args.params is not None and args.params <= 0 or args.gpu_memory_gb <= 0:
        fail("--params and --gpu_memory_gb must be > 0")
    if args.host_memory_gb is not None and args.host_memory_gb <= 0:
        fail(f"--host_memory_gb must be > 0 (got {args.host_memory_gb:g}); leave it out to not check host RAM")
    if args.vocab_size is not None and args.vocab_size < 1:
        fail(f"--vocab_size must be >= 1 (got {args.vocab_size})")
    if args.activation_modes and args.params:
        fail("--activation_modes needs the model's layers: give --model_preset or --config_name instead of --params")
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
