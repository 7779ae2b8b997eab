"""Parallel layouts give the single-process losses, in fp32 within 1e-5 and in bf16 mixed precision
within BF16_TOL of the fp32 single-process run:
- data parallel: FSDP, HSDP, DDP, gradient accumulation; activation checkpointing and per-block
  torch.compile under FSDP;
- tensor + sequence parallel (with and without loss parallel), alone and with FSDP;
- pipeline parallel (1F1B, Interleaved1F1B, ZBVZeroBubble, explicit splits by split points and by
  module lists), alone and with FSDP and TP;
- context parallel (allgather and alltoall rotation), alone and with FSDP, HSDP, TP, PP, op-level
  activation checkpointing, and full activation checkpointing plus compile; Ulysses with op-level
  activation checkpointing plus compile;
- Muon (optimizer.name = "Muon": hidden matrices and stacked experts orthogonalized whole, the work
  spread over the ranks that split them) under FSDP 2, TP 2, PP 2, CP 2, HSDP 2 x 2 and FSDP 2 x TP 2,
  and the experts of Qwen3-MoE (EP 2, EP 2 x FSDP 2) and DeepSeek-V3 (EP 2 x FSDP 2) with Muon;
- Qwen3-MoE's debug flavor without expert parallel under FSDP 2, and with EP 2 alone and with
  CP 2, FSDP 2, TP 2 and PP 2; the expert bias after 6 steps
  and the reported expert loads are the same in every layout;
- DeepSeek-V3's debug flavor (MLA with value heads narrower than query/key heads, shared and
  routed experts) under FSDP 2, TP 2, PP 2, CP 2, EP 2, EP 2 x TP 2 and PP 2 x EP 2, and with
  multi-token prediction (2 depths) under FSDP 2, EP 2, TP 2, CP 2, PP 2, PP 2 x TP 2 and PP 2 x EP 2,
  and with block-causal masks under CP 2 (alltoall), its single-process step 3
  resumed under PP 2 and its PP 2 step 3 under FSDP 4;
- Qwen3's debug flavor under FSDP 2, TP 2, PP 2 and CP 2, and its
  tied-embedding flavor under FSDP 2, TP 2 and FSDP 2 x TP 2, each against its own single process;
- up to PP 2 x FSDP 2 x TP 2, FSDP 2 x CP 2 x TP 2 and PP 2 x CP 2 x TP 2 on 8 processes, and
  PP 2 x FSDP 2 x CP 2 x TP 2 on 16;
- a mixture of three sources (a parquet folder, a jsonl.zst folder, a token folder; training.dataset_mix)
  under FSDP 2 within 1e-5 of one process, with the same data_share/I; its FSDP 2 save at step 3
  resumed under FSDP 4 continues with the single process's losses;
- block-causal attention with the cross-document labels ignored, on a corpus of short documents
  (about 20 tokens, 3 or more per 64-token window): FSDP 2 (and with the per-document split kernel,
  and with op-level activation checkpointing plus compile), FSDP 2 x accumulation 2, TP 2, PP 2
  (1F1B, ZBVZeroBubble, Interleaved1F1B with accumulation 2), CP 2 (both rotations), FSDP 2 x TP 2,
  Qwen3-MoE with EP 2,
  and Qwen3 with sliding windows of 8 under TP 2, PP 2 and CP 2, and gpt-oss's debug flavor (sinks,
  windows of 16 on alternate layers, biased experts) under FSDP 2, TP 2, PP 2, CP 2 (ring), EP 2,
  EP 2 x FSDP 2 and EP 2 x TP 2, and Qwen3.5's debug flavor (gated DeltaNet + gated attention) under
  FSDP 2, TP 2 and PP 2, and its MoE flavor (a sigmoid-gated shared expert) under EP 2, EP 2 x FSDP 2
  and TP 2, each within 1e-5 of its one process; the step-1 loss of FSDP 2 x
  accumulation 2 and of CP 2 equals a loss computed by hand
  (per-token log-softmax over the documents alone, labels after an EOS left out);
- all-to-all (Ulysses) context parallel with block-causal masks: llama3, DeepSeek-V3 (MLA, MTP),
  Qwen3 with sliding windows and gpt-oss under CP 2, and CP 4, CP 2 x TP 2, FSDP 2 x CP 2, PP 2 x CP 2
  and Qwen3-MoE EP 2 x CP 2, each within 1e-5 of its one process; a ring CP 2 save at step 3 resumed
  under Ulysses CP 2 and the reverse continue the single process's losses;
- the output layer and loss in chunks (training.loss_chunk_tokens 48: uneven chunks of each rank's
  tokens) under FSDP 2, TP 2 (vocabulary-sharded log-sum-exp, with and without loss parallel), PP 2,
  CP 2 and PP 2 x TP 2, the tied Qwen3 flavor under TP 2 and DeepSeek-V3 with multi-token prediction
  under TP 2 and PP 2, each within 1e-5 of its unchunked single process, and with validation;
- validation ([validation], every 3 steps and at the last: 2 global batches of 8 held-out sequences)
  gives the single process's loss within 1e-5 under FSDP 2, TP 2, PP 2 (1F1B, and ZBVZeroBubble's
  two stages per rank), CP 2 and Qwen3-MoE's PP 2 x EP 2, and leaves the training losses and grad
  norms bitwise unchanged (the MoE expert bias too, compared as above).

All jobs use the same seed, data and global batch (8 sequences of 64 tokens). Weight init is
layout-invariant (per-parameter seeded), so step 1 already compares identical weights.
"""

import math

import pytest
import torch

from torchtitan.components.data import stdlib_files
from torchtitan.components.tokenizer import Tokenizer

from helpers.data import mixture_corpus, short_documents_corpus
from helpers.launch import FP32_TOL, PP2, SAVE3, launch, losses
from helpers.paths import REPO, TINY

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.compile]

# bf16 parameters/compute against fp32: measured differences on this tiny model stay below 5e-3
# over 6 steps (2.4e-3 at most, FSDP2 and HSDP); the tolerance leaves headroom while still catching a
# wrong gradient or a lost shard.
BF16_TOL = 1e-2

# Qwen3's debug flavors (per-head q/k norms, head_dim independent of dim / n_heads, rotate-half rotary;
# the tied flavor shares the embedding with the output layer). Compared with their own single run.
# The tied flavor trains at half the learning rate: at 2e-3 its gradient norm swings from step to step
# (6.7, 10.0, 2.6, 7.6, 1.7, 7.0) and Adam amplifies the layouts' rounding tenfold a step, to 1e-4 to
# 3e-4 in the step-6 loss and 10% to 20% in its norm; at 1e-3 at most 3.8e-6 and 3.8e-4 (measured).
QWEN = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
QWEN_TIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied", "--optimizer.lr", "1e-3"]
# Qwen3-MoE's debug flavor (8 experts, top-2, aux-loss-free bias balancing). Its jobs save the model
# (buffers included: the expert bias) at step 6, so that the bias can be compared across layouts.
MOE = [
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_moe",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "6",
]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# DeepSeek-V3's debug flavor: MLA (query bottleneck, value heads narrower than query/key heads, YaRN),
# a dense first layer, then experts with a shared expert and sigmoid group-limited routing.
DS = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
MTP2 = ["--model.mtp_depth", "2"]  # multi-token prediction, 2 depths
CP2 = ["--parallelism.context_parallel_degree", "2"]
# gpt-oss's debug flavor: per-head sinks, sliding windows of 16 on layers 0 and 2, biased router, 8 experts
# with biases and the clamped SwiGLU, top-4, no balancing bias (as published; gpt_oss/args.py says why).
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
GPT_OSS_LAYOUTS = [
    "bc_gpt_oss_fsdp2",
    "bc_gpt_oss_tp2",
    "bc_gpt_oss_pp2",
    "bc_gpt_oss_cp2",
    "bc_gpt_oss_ep2",
    "bc_gpt_oss_ep2_ac_op",
    "bc_gpt_oss_ep2_fsdp2",
    "bc_gpt_oss_ep2_tp2",
]
# Qwen3.5's debug flavor: 6 gated DeltaNet layers (the state and conv window reset at each document) and 2 gated
# full-attention layers; TP splits the DeltaNet by head (projections column-wise, conv weights by channel).
QWEN3_5 = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel"]
QWEN3_5_LAYOUTS = [
    "bc_qwen3_5_fsdp2",
    "bc_qwen3_5_tp2",
    "bc_qwen3_5_pp2",
    "bc_qwen3_5_cp2",
    "bc_qwen3_5_cp2_ulysses",
    "bc_qwen3_5_cp4",
    "bc_qwen3_5_tp2_cp2",
    "bc_qwen3_5_moe_ep2",
    "bc_qwen3_5_moe_ep2_fsdp2",
    "bc_qwen3_5_moe_tp2",
]
# Qwen3.5-MoE's debug flavor: the same mixers, every feed-forward 8 experts top-2 plus a shared expert scaled by
# its sigmoid gate; compared with its own single process (bc_qwen3_5_moe_single).
QWEN3_5_MOE = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe"]
# Validation at steps 3 and 6 on 2 global batches of 8 sequences of the default held-out set (the
# standard library's tests); the local batch is 8 / data-parallel degree, so every layout reads the same set.
VAL = ["--validation.enabled", "--validation.freq", "3", "--validation.steps", "2"]

# Muon for the hidden matrices. Its Newton-Schulz iteration raises a matrix's near-zero singular values about
# 3.4-fold per iteration, so the layouts' float32 rounding of the gradients grows faster than under AdamW: at
# Muon's lr 2e-3 the step-6 loss of FSDP 2, TP 2 and EP 2 measured 1.2e-5 to 1.4e-5 off one process; at 5e-4,
# at most 1.9e-6 in every Muon case below. Orthogonalizing each FSDP shard alone (not the whole matrix) is off
# by 4.4e-4 at step 2 (measured), so the cases still tell a wrong update from rounding.
# Newton-Schulz in float32: in bf16 it is most of a step's time on a CPU without native bf16 (a 6-step job took
# 60 to 210 s there); the layouts' agreement is the same question in either dtype.
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_lr", "5e-4", "--optimizer.muon_ns_dtype", "float32"]
MOE_MUON = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"] + MUON


def val(local_batch_size: int) -> list[str]:
    return VAL + ["--validation.local_batch_size", str(local_batch_size)]


SINGLE = {
    "single_fp32": ["--training.local_batch_size", "8"],
    "single_fp32_accum4": ["--training.local_batch_size", "2"],
    "single_bf16": ["--training.local_batch_size", "8", "--training.mixed_precision_param", "bfloat16"],
    "qwen3_single": QWEN + ["--training.local_batch_size", "8"],
    "qwen3_tied_single": QWEN_TIED + SAVE3 + ["--training.local_batch_size", "8"],
    "moe_single": MOE + ["--training.local_batch_size", "8"] + val(8),
    "ds_single": DS + ["--training.local_batch_size", "8"],
    "ds_mtp_single": DS + MTP2 + SAVE3 + ["--training.local_batch_size", "8"],
    "muon_single": MUON + ["--training.local_batch_size", "8"],
    "moe_muon_single": MOE_MUON + ["--training.local_batch_size", "8"],
    "ds_muon_single": DS + MUON + ["--training.local_batch_size", "8"],
    # single_fp32 with validation: its training losses must be bitwise single_fp32's.
    "single_fp32_val": ["--training.local_batch_size", "8"] + val(8),
}
# training.loss_chunk_tokens: 48 tokens, which divides no rank's share (512, 256 or 128 tokens per micro-batch).
CHUNK = ["--training.loss_chunk_tokens", "48"]
TWO = {
    "fsdp2": ["--training.local_batch_size", "4"] + val(4),
    "fsdp2_accum2": ["--training.local_batch_size", "2"],
    "fsdp2_never_reshard": ["--training.local_batch_size", "4", "--parallelism.fsdp_reshard_after_forward", "never"],
    "ddp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ],
    "fsdp2_bf16": ["--training.local_batch_size", "4", "--training.mixed_precision_param", "bfloat16"],
    "fsdp2_ac_full": ["--training.local_batch_size", "4", "--activation_checkpoint.mode", "full"],
    "fsdp2_ac_op_compile": [
        "--training.local_batch_size",
        "4",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--training.compile",
    ],
    "tp2": ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"] + val(8),
    "tp2_no_loss_parallel": [
        "--training.local_batch_size",
        "8",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.disable_loss_parallel",
    ],
    "pp2_1f1b": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ]
    + val(8),
    "pp2_interleaved": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    ],
    "pp2_zbv": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "ZBVZeroBubble",
    ]
    + val(8),
    "pp2_split_points": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--parallelism.pipeline_parallel_split_points",
        "layers.2",
    ],
    "pp2_module_fqns_interleaved": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--parallelism.module_fqns_per_model_part",
        "tok_embeddings;layers.0,layers.1,layers.2;layers.3,layers.4;layers.5,norm,output",
    ],
    "cp2_allgather": ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"] + val(8),
    "cp2_alltoall": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_rotate_method",
        "alltoall",
    ],
    "cp2_alltoall_ac_op": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_rotate_method",
        "alltoall",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    "cp2_alltoall_ac_compile": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_rotate_method",
        "alltoall",
        "--activation_checkpoint.mode",
        "full",
        "--training.compile",
    ],
    # Ulysses' all-to-alls inside op-level checkpointing (recomputed in backward) and between compiled graphs.
    "cp2_ulysses_ac_op_compile": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "ulysses",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--training.compile",
    ],
    # Pipeline with gradient accumulation (2 micro-batches of 4 per step, each split into 2 microbatches).
    "pp2_accum2": ["--training.local_batch_size", "4"] + PP2,
    "qwen3_fsdp2": QWEN + ["--training.local_batch_size", "4"],
    "qwen3_tp2": QWEN + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "qwen3_pp2": QWEN + ["--training.local_batch_size", "8"] + PP2,
    "qwen3_cp2": QWEN + ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"],
    "qwen3_tied_fsdp2": QWEN_TIED + ["--training.local_batch_size", "4"],
    "qwen3_tied_tp2": QWEN_TIED + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    # Tied across pipeline stages: one copy per stage kept equal (the pp group carries the gradient
    # sum; under ZBVZeroBubble both copies are on one rank). The PP 2 job saves at step 3 for a
    # resume under FSDP 4; the single process's step 3 resumes under ZBVZeroBubble.
    "qwen3_tied_pp2": QWEN_TIED + SAVE3 + ["--training.local_batch_size", "8"] + PP2,
    "qwen3_tied_pp2_zbv": QWEN_TIED
    + ["--training.local_batch_size", "8"]
    + PP2
    + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
    "copy_tied_single": {
        "copy": ["{tmp}/qwen3_tied_single/checkpoint/step-3", "{tmp}/qwen3_tied_pp2_zbv_resumed/checkpoint/step-3"]
    },
    "qwen3_tied_pp2_zbv_resumed": QWEN_TIED
    + SAVE3
    + ["--training.local_batch_size", "8"]
    + PP2
    + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
    "moe_fsdp2": MOE + ["--training.local_batch_size", "4"],
    "muon_fsdp2": MUON + ["--training.local_batch_size", "4"],
    "muon_tp2": MUON + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "muon_pp2": MUON + ["--training.local_batch_size", "8"] + PP2,
    "muon_cp2": MUON + ["--training.local_batch_size", "8"] + CP2,
    "moe_muon_ep2": MOE_MUON + ["--training.local_batch_size", "4"] + EP2,
    "moe_ep2": MOE + ["--training.local_batch_size", "4"] + EP2,
    "moe_ep2_cp2": MOE + ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"] + EP2,
    "ds_fsdp2": DS + ["--training.local_batch_size", "4"],
    "ds_tp2": DS + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "ds_pp2": DS + ["--training.local_batch_size", "8"] + PP2,
    "ds_cp2": DS + ["--training.local_batch_size", "8"] + CP2,
    "ds_ep2": DS + ["--training.local_batch_size", "4"] + EP2,
    "ds_mtp_fsdp2": DS + MTP2 + ["--training.local_batch_size", "4"],
    "ds_mtp_ep2": DS + MTP2 + ["--training.local_batch_size", "4"] + EP2,
    "ds_mtp_tp2": DS + MTP2 + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "ds_mtp_cp2": DS + MTP2 + ["--training.local_batch_size", "8"] + CP2,
    # MTP's last stage borrows the input embedding (one weight, one checkpoint entry under its name):
    # PP 2 saves at step 3 for a resume under FSDP 4; the single process's step 3 resumes under PP 2.
    "ds_mtp_pp2": DS + MTP2 + SAVE3 + ["--training.local_batch_size", "8"] + PP2,
    "copy_ds_mtp_single": {
        "copy": ["{tmp}/ds_mtp_single/checkpoint/step-3", "{tmp}/ds_mtp_pp2_resumed/checkpoint/step-3"]
    },
    "ds_mtp_pp2_resumed": DS + MTP2 + SAVE3 + ["--training.local_batch_size", "8"] + PP2,
    "chunk_fsdp2": CHUNK + ["--training.local_batch_size", "4"] + val(4),
    "chunk_fsdp2_accum2": CHUNK + ["--training.local_batch_size", "2"],
    "chunk_tp2": CHUNK + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"] + val(8),
    "chunk_tp2_no_loss_parallel": CHUNK
    + [
        "--training.local_batch_size",
        "8",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.disable_loss_parallel",
    ],
    "chunk_pp2": CHUNK + ["--training.local_batch_size", "8"] + PP2 + val(8),
    "chunk_cp2": CHUNK + ["--training.local_batch_size", "8"] + CP2 + val(8),
    "qwen3_tied_chunk_tp2": QWEN_TIED
    + CHUNK
    + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "ds_mtp_chunk_tp2": DS
    + MTP2
    + CHUNK
    + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "ds_mtp_chunk_pp2": DS + MTP2 + CHUNK + ["--training.local_batch_size", "8"] + PP2,
}
FOUR = {
    "hsdp2x2_bf16": [
        "--training.local_batch_size",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--training.mixed_precision_param",
        "bfloat16",
    ],
    "hsdp2x2": ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"],
    "fsdp4": ["--training.local_batch_size", "2"],
    "fsdp2_tp2": ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"],
    "pp2_fsdp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
    "pp2_fsdp2_zbv": [
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--parallelism.pipeline_parallel_schedule",
        "ZBVZeroBubble",
    ],
    "pp2_tp2": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
    "fsdp2_cp2": ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2"],
    "hsdp2_cp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
    ],
    "cp4_alltoall": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "4",
        "--parallelism.context_parallel_rotate_method",
        "alltoall",
    ],
    "cp2_tp2": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
    "pp2_cp2": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
    "fsdp2_cp2_bf16": [
        "--training.local_batch_size",
        "4",
        "--parallelism.context_parallel_degree",
        "2",
        "--training.mixed_precision_param",
        "bfloat16",
    ],
    "qwen3_tied_fsdp2_tp2": QWEN_TIED
    + ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"],
    "qwen3_tied_pp2_fsdp2": QWEN_TIED + ["--training.local_batch_size", "4"] + PP2,
    # Four stages: the copies are on pp ranks 0 and 3, summed over a group of those two.
    "qwen3_tied_pp4": QWEN_TIED
    + [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "4",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
    "copy_tied_pp2": {
        "copy": ["{tmp}/qwen3_tied_pp2/checkpoint/step-3", "{tmp}/qwen3_tied_fsdp4_resumed/checkpoint/step-3"]
    },
    "qwen3_tied_fsdp4_resumed": QWEN_TIED + SAVE3 + ["--training.local_batch_size", "2"],
    "moe_ep2_fsdp2": MOE + ["--training.local_batch_size", "2"] + EP2,
    "muon_fsdp2_tp2": MUON + ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"],
    "moe_muon_ep2_fsdp2": MOE_MUON + ["--training.local_batch_size", "2"] + EP2,
    "muon_hsdp2x2": MUON + ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"],
    "ds_muon_ep2_fsdp2": DS + MUON + ["--training.local_batch_size", "2"] + EP2,
    "moe_ep2_tp2": MOE + ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"] + EP2,
    "moe_pp2_ep2": MOE + ["--training.local_batch_size", "4"] + PP2 + EP2 + val(4),
    "ds_ep2_tp2": DS + ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"] + EP2,
    "ds_pp2_ep2": DS + ["--training.local_batch_size", "4"] + PP2 + EP2,
    "ds_mtp_pp2_tp2": DS
    + MTP2
    + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]
    + PP2,
    "ds_mtp_pp2_ep2": DS + MTP2 + ["--training.local_batch_size", "4"] + PP2 + EP2,
    "copy_ds_mtp_pp2": {"copy": ["{tmp}/ds_mtp_pp2/checkpoint/step-3", "{tmp}/ds_mtp_fsdp4_resumed/checkpoint/step-3"]},
    "ds_mtp_fsdp4_resumed": DS + MTP2 + SAVE3 + ["--training.local_batch_size", "2"],
    "chunk_pp2_tp2": CHUNK + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"] + PP2,
}
EIGHT = {
    "pp2_fsdp2_tp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
    "fsdp2_cp2_tp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_rotate_method",
        "alltoall",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
    "pp2_cp2_tp2": [
        "--training.local_batch_size",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
}
# Every dimension of the mesh at once: 16 processes (about 50 s for the launch on 2 cores).
SIXTEEN = {
    "pp2_fsdp2_cp2_tp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
}


DS_LAYOUTS = [
    "ds_fsdp2",
    "ds_tp2",
    "ds_pp2",
    "ds_cp2",
    "ds_ep2",
    "ds_ep2_tp2",
    "ds_pp2_ep2",
    "ds_mtp_fsdp2",
    "ds_mtp_ep2",
    "ds_mtp_tp2",
    "ds_mtp_cp2",
    "ds_mtp_pp2",
    "ds_mtp_pp2_tp2",
    "ds_mtp_pp2_ep2",
]
MUON_LAYOUTS = [
    "muon_fsdp2",
    "muon_tp2",
    "muon_pp2",
    "muon_cp2",
    "muon_fsdp2_tp2",
    "muon_hsdp2x2",
    "moe_muon_ep2",
    "moe_muon_ep2_fsdp2",
    "ds_muon_ep2_fsdp2",
]
CHUNK_LAYOUTS = [
    "chunk_fsdp2",
    "chunk_fsdp2_accum2",
    "chunk_tp2",
    "chunk_tp2_no_loss_parallel",
    "chunk_pp2",
    "chunk_cp2",
    "chunk_pp2_tp2",
    "qwen3_tied_chunk_tp2",
    "ds_mtp_chunk_tp2",
    "ds_mtp_chunk_pp2",
]
MOE_LAYOUTS = ["moe_fsdp2", "moe_ep2", "moe_ep2_cp2", "moe_ep2_fsdp2", "moe_ep2_tp2", "moe_pp2_ep2"]


def mixture_jobs(tmp) -> tuple[dict, dict, dict]:
    """A recipe mixing a parquet folder, a jsonl.zst folder and a token folder (documents of the standard
    library, the real tokenizer): one process, FSDP 2 (saving at step 3), and FSDP 4 resumed from that save."""
    files = stdlib_files()
    docs = [[f.read_text(errors="replace") for f in files[i * 30 : (i + 1) * 30]] for i in range(3)]
    paths = mixture_corpus(tmp / "mix_corpus", docs, Tokenizer(str(REPO / "assets/tokenizer/python_stdlib_4k.model")))
    mix = ["--training.dataset_mix", ",".join(f"{w}:{p}" for w, p in zip((0.5, 0.3, 0.2), paths))]
    save3 = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.no-last_save_model_only"]
    copy = {
        "copy": [
            str(tmp / "mix_fsdp2" / "checkpoint" / "step-3"),
            str(tmp / "mix_fsdp4_resumed" / "checkpoint" / "step-3"),
        ]
    }
    return (
        {"mix_single": mix + ["--training.local_batch_size", "8"]},
        {"mix_fsdp2": mix + save3 + ["--training.local_batch_size", "4"]},
        {"copy_mix": copy, "mix_fsdp4_resumed": mix + save3 + ["--training.local_batch_size", "2"]},
    )


def block_causal_args(tmp) -> list[str]:
    corpus = tmp / "short_docs.jsonl"
    if not corpus.exists():
        short_documents_corpus(corpus)
    return [
        "--training.dataset",
        "local",
        "--training.dataset_path",
        str(corpus),
        "--model.attn_mask_type",
        "block_causal",
        "--training.ignore_cross_document_labels",
    ]


def block_causal_jobs(tmp) -> tuple[dict, dict, dict]:
    """Block-causal attention on short documents, labels across documents ignored (reference: bc_single;
    bc_qwen3_window_*: Qwen3 with sliding windows of 8, bc_moe_*: the MoE flavor, bc_ds_mtp_*: DeepSeek-V3
    with multi-token prediction). sd_causal_single:
    the same data with causal attention, every label counted."""
    bc = block_causal_args(tmp)
    window = QWEN + ["--model.sliding_window", "8", "--model.max_window_layers", "1"]
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
    lb = lambda n: ["--training.local_batch_size", str(n)]  # noqa: E731
    gpt_oss = bc + GPT_OSS
    return (
        {
            "bc_single": bc + lb(8) + val(8),
            "bc_qwen3_window_single": bc + window + lb(8),
            "bc_moe_single": bc + moe + lb(8),
            "sd_causal_single": bc[:4] + lb(8),
            "bc_ds_mtp_single": bc + DS + MTP2 + lb(8),
            "bc_gpt_oss_single": gpt_oss + lb(8),
            "bc_qwen3_5_single": bc + QWEN3_5 + lb(8),
            "bc_qwen3_5_moe_single": bc + QWEN3_5_MOE + lb(8),
        },
        {
            "bc_fsdp2": bc + lb(4) + val(4),
            "bc_fsdp2_split": bc + lb(4) + ["--model.attn_backend", "split"],
            "bc_fsdp2_accum2": bc + lb(2),
            "bc_tp2": bc + lb(8) + ["--parallelism.tensor_parallel_degree", "2"],
            "bc_pp2": bc + lb(8) + PP2 + val(8),
            "bc_pp2_zbv": bc + lb(8) + PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "bc_pp2_interleaved_accum2": bc
            + lb(4)
            + PP2
            + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
            "bc_fsdp2_ac_op_compile": bc
            + lb(4)
            + [
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "op",
                "--training.compile",
            ],
            "bc_cp2_allgather": bc + lb(8) + CP2 + val(8),
            "bc_cp2_alltoall": bc + lb(8) + CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall"],
            "bc_moe_ep2": bc + moe + lb(4) + EP2,
            # Multi-token prediction's targets and its blocks' masks under the ring, per document.
            "bc_ds_mtp_cp2": bc
            + DS
            + MTP2
            + lb(8)
            + CP2
            + ["--parallelism.context_parallel_rotate_method", "alltoall"],
            "bc_qwen3_window_tp2": bc + window + lb(8) + ["--parallelism.tensor_parallel_degree", "2"],
            "bc_qwen3_window_pp2": bc + window + lb(8) + PP2,
            "bc_qwen3_window_cp2": bc
            + window
            + lb(8)
            + CP2
            + ["--parallelism.context_parallel_rotate_method", "alltoall"],
            **gpt_oss_jobs(gpt_oss, 2),
            **ulysses_jobs(tmp, 2),
            # Qwen3.5 (measured: FSDP 2 5.2e-6, TP 2 4.8e-6, PP 2 9.5e-7 from its one process over 6 steps).
            "bc_qwen3_5_fsdp2": bc + QWEN3_5 + lb(4),
            "bc_qwen3_5_tp2": bc + QWEN3_5 + lb(8) + ["--parallelism.tensor_parallel_degree", "2"],
            "bc_qwen3_5_pp2": bc + QWEN3_5 + lb(8) + PP2,
            # Context parallel: the DeltaNet layers head-parallel by all-to-all, the attention layers
            # under the ring or Ulysses (measured: 4.8e-6 either way).
            "bc_qwen3_5_cp2": bc + QWEN3_5 + lb(8) + CP2,
            "bc_qwen3_5_cp2_ulysses": bc + QWEN3_5 + lb(8) + CP2 + ULYSSES,
            # Qwen3.5-MoE under expert parallel (measured: EP 2 3.3e-6 from its one process over 6 steps).
            "bc_qwen3_5_moe_ep2": bc + QWEN3_5_MOE + lb(4) + EP2,
            # TP 2: the MoE blocks token-local, the shared gate's gradient summed over the ranks (3.8e-6).
            "bc_qwen3_5_moe_tp2": bc + QWEN3_5_MOE + lb(8) + ["--parallelism.tensor_parallel_degree", "2"],
        },
        {
            "bc_fsdp2_tp2": bc + lb(4) + ["--parallelism.tensor_parallel_degree", "2"],
            **gpt_oss_jobs(gpt_oss, 4),
            "bc_qwen3_5_cp4": bc
            + QWEN3_5
            + lb(8)
            + [
                "--parallelism.context_parallel_degree",
                "4",
                "--parallelism.context_parallel_rotate_method",
                "alltoall",
            ],
            "bc_qwen3_5_tp2_cp2": bc + QWEN3_5 + lb(8) + CP2 + ["--parallelism.tensor_parallel_degree", "2"],
            # Qwen3.5-MoE, EP 2 x FSDP 2 (measured: 5.7e-6).
            "bc_qwen3_5_moe_ep2_fsdp2": bc + QWEN3_5_MOE + lb(2) + EP2,
            **ulysses_jobs(tmp, 4),
        },
    )


ULYSSES = ["--parallelism.context_parallel_method", "ulysses"]
ULYSSES_LAYOUTS = [
    "bc_cp2_ulysses",
    "bc_ds_mtp_cp2_ulysses",
    "bc_qwen3_window_cp2_ulysses",
    "bc_gpt_oss_cp2_ulysses",
    "bc_cp4_ulysses",
    "bc_cp2_tp2_ulysses",
    "bc_fsdp2_cp2_ulysses",
    "bc_pp2_cp2_ulysses",
    "bc_moe_ep2_cp2_ulysses",
]


def ulysses_jobs(tmp, nproc: int) -> dict:
    """All-to-all (Ulysses) context parallel with block-causal masks: llama3, DeepSeek-V3's MLA (with MTP),
    Qwen3 with sliding windows and gpt-oss's sinks under CP 2; a ring CP 2 save at step 3 resumed under
    Ulysses CP 2 and the reverse (2 processes); CP 4, CP 2 x TP 2, FSDP 2 x CP 2, PP 2 x CP 2 and
    Qwen3-MoE EP 2 x CP 2 (4 processes)."""
    bc = block_causal_args(tmp)
    lb = lambda n: ["--training.local_batch_size", str(n)]  # noqa: E731
    ring = CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall"]
    window = QWEN + ["--model.sliding_window", "8", "--model.max_window_layers", "1"]
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]

    def copy(src, dst):
        return {"copy": [f"{{tmp}}/{src}/checkpoint/step-3", f"{{tmp}}/{dst}/checkpoint/step-3"]}

    if nproc == 2:
        return {
            "bc_cp2_ulysses": bc + lb(8) + CP2 + ULYSSES + SAVE3,
            "bc_ds_mtp_cp2_ulysses": bc + DS + MTP2 + lb(8) + CP2 + ULYSSES,
            "bc_qwen3_window_cp2_ulysses": bc + window + lb(8) + CP2 + ULYSSES,
            "bc_gpt_oss_cp2_ulysses": bc + GPT_OSS + lb(8) + CP2 + ULYSSES,
            "bc_cp2_ring_saved": bc + lb(8) + ring + SAVE3,
            "copy_ring_to_ulysses": copy("bc_cp2_ring_saved", "bc_cp2_ulysses_from_ring"),
            "bc_cp2_ulysses_from_ring": bc + lb(8) + CP2 + ULYSSES + SAVE3,
            "copy_ulysses_to_ring": copy("bc_cp2_ulysses", "bc_cp2_ring_from_ulysses"),
            "bc_cp2_ring_from_ulysses": bc + lb(8) + ring + SAVE3,
        }
    cp = ["--parallelism.context_parallel_degree"]
    return {
        "bc_cp4_ulysses": bc + lb(8) + cp + ["4"] + ULYSSES,
        "bc_cp2_tp2_ulysses": bc + lb(8) + CP2 + ULYSSES + ["--parallelism.tensor_parallel_degree", "2"],
        "bc_fsdp2_cp2_ulysses": bc + lb(4) + CP2 + ULYSSES,
        "bc_pp2_cp2_ulysses": bc + lb(8) + CP2 + ULYSSES + PP2,
        "bc_moe_ep2_cp2_ulysses": bc + moe + lb(4) + CP2 + ULYSSES + EP2,
    }


def gpt_oss_jobs(gpt_oss: list[str], nproc: int) -> dict:
    """gpt-oss (sinks, windows of 16 on alternate layers, 8 biased experts top-4) with block-causal masks:
    the 2-process layouts, or the 4-process EP x FSDP and EP x TP."""
    lb = lambda n: ["--training.local_batch_size", str(n)]  # noqa: E731
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    if nproc == 2:
        return {
            "bc_gpt_oss_fsdp2": gpt_oss + lb(4),
            "bc_gpt_oss_tp2": gpt_oss + lb(8) + tp2,
            "bc_gpt_oss_pp2": gpt_oss + lb(8) + PP2,
            "bc_gpt_oss_cp2": gpt_oss + lb(8) + CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall"],
            "bc_gpt_oss_ep2": gpt_oss + lb(4) + EP2,
            # The op policy inside blocks whose experts FSDP wraps apart (their hooks' profiler marks
            # run inside the checkpointed region) and with biased projections (addmm).
            "bc_gpt_oss_ep2_ac_op": gpt_oss
            + lb(4)
            + EP2
            + ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
        }
    return {"bc_gpt_oss_ep2_fsdp2": gpt_oss + lb(2) + EP2, "bc_gpt_oss_ep2_tp2": gpt_oss + lb(4) + tp2 + EP2}


BC_LAYOUTS = [
    "bc_fsdp2",
    "bc_fsdp2_split",
    "bc_fsdp2_accum2",
    "bc_tp2",
    "bc_pp2",
    "bc_pp2_zbv",
    "bc_pp2_interleaved_accum2",
    "bc_fsdp2_ac_op_compile",
    "bc_cp2_allgather",
    "bc_cp2_alltoall",
    "bc_moe_ep2",
    "bc_ds_mtp_cp2",
    "bc_qwen3_window_tp2",
    "bc_qwen3_window_pp2",
    "bc_qwen3_window_cp2",
    "bc_fsdp2_tp2",
    *GPT_OSS_LAYOUTS,
    *QWEN3_5_LAYOUTS,
    *ULYSSES_LAYOUTS,
    "bc_cp2_ring_saved",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_parity")
    mix1, mix2, mix4 = mixture_jobs(tmp)
    bc1, bc2, bc4 = block_causal_jobs(tmp)
    results = {}
    results.update(launch(SINGLE | mix1 | bc1, 1, tmp))
    # The two largest launches (about 40 jobs each) get more than the default 600 s: each job's gloo
    # groups live until the launch ends, so late jobs slow down (measured: 6.5 min for the 4-rank one on
    # a quiet host; a busy CI host runs 1.5x slower).
    results.update(launch(TWO | mix2 | bc2, 2, tmp, timeout=1500))
    results.update(launch(FOUR | mix4 | bc4, 4, tmp, timeout=1500))
    results.update(launch(EIGHT, 8, tmp))
    results.update(launch(SIXTEEN, 16, tmp))
    # Validation records (step, validation_loss, ...) apart from the training steps' records.
    validation = {name: [r for r in records if "validation_loss" in r] for name, records in results.items()}
    results = {name: [r for r in records if "loss" in r] for name, records in results.items()}
    results["_tmp"], results["_validation"] = tmp, validation
    return results


def reference_of(name: str) -> str:
    for prefix in (
        "bc_gpt_oss",
        "bc_qwen3_5_moe",
        "bc_qwen3_5",
        "bc_qwen3_window",
        "bc_moe",
        "bc_ds_mtp",
        "bc",
        "qwen3_tied",
        "qwen3",
        "moe_muon",
        "muon",
        "moe",
        "ds_mtp",
        "ds_muon",
        "ds",
    ):
        if name.startswith(prefix):
            return f"{prefix}_single"
    return "single_fp32"


@pytest.mark.parametrize(
    "name",
    [
        "single_fp32",
        "qwen3_single",
        "qwen3_tied_single",
        "moe_single",
        "bc_single",
        "bc_qwen3_window_single",
        "bc_gpt_oss_single",
        "bc_qwen3_5_single",
        "bc_qwen3_5_moe_single",
        "ds_single",
        "ds_mtp_single",
        "bc_ds_mtp_single",
    ],
)
def test_reference_learns(runs, name):
    ref = losses(runs[name])
    assert len(ref) == 6
    assert ref[-1] < ref[0] - 0.5


def test_qwen3_is_another_model(runs):
    # Same data and seed: a different architecture gives different losses from step 1 on, and tying
    # the embeddings changes the model again.
    assert losses(runs["qwen3_single"])[0] != losses(runs["single_fp32"])[0]
    assert losses(runs["qwen3_tied_single"])[0] != losses(runs["qwen3_single"])[0]


def test_mtp_moves_the_gradient_not_the_logged_loss(runs):
    # Same initial weights (per-name seeds): step 1 logs the same next-token loss; the MTP depths'
    # gradient then changes the training (by 6e-4 at step 2 to 2e-2 at step 6, measured), far beyond
    # the layouts' 1e-5, so the MTP parity cases below would see a lost or misaligned MTP target.
    with_mtp, without = losses(runs["ds_mtp_single"]), losses(runs["ds_single"])
    assert with_mtp[0] == without[0]
    assert min(abs(a - b) for a, b in zip(with_mtp[1:], without[1:])) > 1e-4


@pytest.mark.parametrize(
    "name",
    [
        "single_fp32_accum4",
        "fsdp2",
        "fsdp2_accum2",
        "fsdp2_never_reshard",
        "ddp2",
        "hsdp2x2",
        "fsdp4",
        "fsdp2_ac_full",
        "fsdp2_ac_op_compile",
        "tp2",
        "tp2_no_loss_parallel",
        "fsdp2_tp2",
        "pp2_1f1b",
        "pp2_interleaved",
        "pp2_zbv",
        "pp2_fsdp2",
        "pp2_fsdp2_zbv",
        "pp2_tp2",
        "pp2_fsdp2_tp2",
        "pp2_split_points",
        "pp2_module_fqns_interleaved",
        "cp2_allgather",
        "cp2_alltoall",
        "cp2_alltoall_ac_op",
        "cp2_alltoall_ac_compile",
        "cp2_ulysses_ac_op_compile",
        "fsdp2_cp2",
        "hsdp2_cp2",
        "cp4_alltoall",
        "cp2_tp2",
        "pp2_cp2",
        "fsdp2_cp2_tp2",
        "pp2_cp2_tp2",
        "pp2_fsdp2_cp2_tp2",
        "pp2_accum2",
        "qwen3_fsdp2",
        "qwen3_tp2",
        "qwen3_pp2",
        "qwen3_cp2",
        "qwen3_tied_fsdp2",
        "qwen3_tied_tp2",
        "qwen3_tied_fsdp2_tp2",
        "qwen3_tied_pp2",
        "qwen3_tied_pp2_zbv",
        "qwen3_tied_pp2_fsdp2",
        "qwen3_tied_pp4",
        *MOE_LAYOUTS,
        *BC_LAYOUTS,
        *DS_LAYOUTS,
        *MUON_LAYOUTS,
        *CHUNK_LAYOUTS,
    ],
)
def test_fp32_layouts_match_single_process(runs, name):
    reference = reference_of(name)
    ref, got = losses(runs[reference]), losses(runs[name])
    assert len(got) == len(ref) == 6
    diffs = [abs(a - b) for a, b in zip(ref, got)]
    assert max(diffs) < FP32_TOL, f"{name}: per-step |loss diff| {diffs}"
    # The global grad norm is the same quantity in every layout too. Its tolerance is relative 1e-3:
    # torch's fp32 norm kernel on CPU loses ~1e-4 relative over a 500k-element shard (measured
    # against float64), so different shardings round differently.
    norms = [abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(runs[reference], runs[name])]
    # The tied flavor's gradient norm reacts more to rounding (its norm is 1.7 to 8 against 1.1
    # to 2.1 untied): measured at most 1.7e-4 under plain FSDP 2 and 2.6e-4 / 3.8e-4 under TP 2 /
    # FSDP 2 x TP 2, with loss differences of at most 3.8e-6 throughout.
    norm_tol = 3e-3 if "tied" in name else 1e-3
    assert max(norms) < norm_tol, f"{name}: grad norm relative diffs {norms}"


def test_muon_is_another_optimizer(runs):
    # The same weights at step 1, then Muon's updates: other losses than AdamW's, and still falling.
    for muon, adamw in (("muon_single", "single_fp32"), ("moe_muon_single", "moe_single")):
        assert losses(runs[muon])[0] == losses(runs[adamw])[0]
        assert losses(runs[muon])[1] != losses(runs[adamw])[1]
        assert losses(runs[muon])[-1] < losses(runs[muon])[0] - 0.3


@pytest.mark.parametrize("name", ["single_bf16", "fsdp2_bf16", "hsdp2x2_bf16", "fsdp2_cp2_bf16"])
def test_bf16_layouts_track_fp32(runs, name):
    ref, got = losses(runs["single_fp32"]), losses(runs[name])
    diffs = [abs(a - b) for a, b in zip(ref, got)]
    assert max(diffs) < BF16_TOL, f"{name}: per-step |loss diff| {diffs}"
    assert got != ref  # bf16 really ran in bf16


def test_moe_expert_bias_is_the_same_in_every_layout(runs):
    # The bias moves after every step by the sign of (mean load - expert load), with the counts
    # summed over all ranks of a stage: a count taken over the wrong ranks changes the signs.
    from torchtitan.components.checkpoint import read_dcp_model
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("qwen3")
    folder = runs["_tmp"]

    def biases(name):
        sd, _, _ = read_dcp_model(folder / name / "checkpoint" / "step-6", spec)
        return {k: v for k, v in sd.items() if k.endswith("expert_bias")}

    ref = biases("moe_single")
    assert len(ref) == 4 and all(v.abs().sum() > 0 for v in ref.values())  # the bias did move
    for name in MOE_LAYOUTS:
        got = biases(name)
        assert got.keys() == ref.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], atol=1e-7, rtol=0, msg=f"{name} {key}")


def test_moe_expert_load_is_reported(runs):
    for record in runs["moe_ep2_fsdp2"]:
        assert 1.0 <= record["moe_max_over_mean"] <= 8.0 and record["moe_dropped"] == 0.0
        layers = {k.split("/")[1] for k in record if k.startswith("moe/")}
        assert layers == {"layer0", "layer1", "layer2", "layer3"}
        assert record["moe/layer0/mean_load"] == 8 * 64 * 2 / 8  # assignments of the step per expert
    # Every layout reports the same loads (counts summed over the same tokens).
    for name in MOE_LAYOUTS:
        assert [r["moe/layer3/max_load"] for r in runs[name]] == [r["moe/layer3/max_load"] for r in runs["moe_single"]]


def test_bf16_fsdp_layouts_agree(runs):
    # FSDP2 and HSDP with the same bf16 policy differ only by reduction order.
    a, b = losses(runs["fsdp2_bf16"]), losses(runs["hsdp2x2_bf16"])
    assert max(abs(x - y) for x, y in zip(a, b)) < 5e-3


def test_metrics_records_have_the_documented_keys(runs):
    for record in runs["fsdp2"]:
        assert {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "time"} <= set(record)
        assert record["tps"] > 0 and record["memory_gib"] > 0
    assert [r["step"] for r in runs["fsdp2"]] == [1, 2, 3, 4, 5, 6]


VAL_LAYOUTS = [
    "fsdp2",
    "tp2",
    "pp2_1f1b",
    "pp2_zbv",
    "cp2_allgather",
    "moe_pp2_ep2",
    "bc_fsdp2",
    "bc_pp2",
    "bc_cp2_allgather",
    "chunk_fsdp2",
    "chunk_tp2",
    "chunk_pp2",
    "chunk_cp2",
]


@pytest.mark.parametrize("name", VAL_LAYOUTS)
def test_validation_loss_is_the_same_in_every_layout(runs, name):
    reference = "moe_single" if name.startswith("moe") else "bc_single" if name.startswith("bc_") else "single_fp32_val"
    ref, got = runs["_validation"][reference], runs["_validation"][name]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [3, 6]
    diffs = [abs(a["validation_loss"] - b["validation_loss"]) for a, b in zip(ref, got)]
    # Measured: at most 3.8e-6 (FSDP 2, TP 2, CP 2), 5.4e-6 (MoE PP 2 x EP 2), 2.4e-7 (PP 2).
    assert max(diffs) < FP32_TOL, f"{name}: validation loss diffs {diffs}"
    for r in got:
        assert r["validation_batches"] == 2 and r["validation_tokens"] == 2 * 8 * 64
        assert r["validation_perplexity"] == pytest.approx(math.exp(r["validation_loss"]))


def test_validation_does_not_change_training(runs):
    with_val, without = runs["single_fp32_val"], runs["single_fp32"]
    assert [(r["loss"], r["grad_norm"]) for r in with_val] == [(r["loss"], r["grad_norm"]) for r in without]
    ref = runs["_validation"]["single_fp32_val"]
    # It measures the model being trained: held-out loss falls from step 3 to step 6 (8.05 -> 7.76 measured
    # on the lanes' samples; 7.51 -> 6.95 on the old stored order, whose consecutive windows of a few
    # files the model fitted faster).
    assert ref[1]["validation_loss"] < ref[0]["validation_loss"] - 0.2
    assert runs["_validation"]["single_fp32"] == []


def test_mixture_fsdp2_and_resumed_under_fsdp4_match_one_process(runs):
    ref = runs["mix_single"]
    assert len(ref) == 6 and losses(ref) != losses(runs["single_fp32"])  # other data than the default
    for got in (runs["mix_fsdp2"], runs["mix_fsdp4_resumed"]):
        for r, g in zip(ref[-len(got) :], got):
            assert r["step"] == g["step"] and g["loss"] == pytest.approx(r["loss"], rel=FP32_TOL)
    assert [r["step"] for r in runs["mix_fsdp4_resumed"]] == [4, 5, 6]
    shares = [[r[f"data_share/{i}"] for i in range(3)] for r in ref]
    assert shares == [[r[f"data_share/{i}"] for i in range(3)] for r in runs["mix_fsdp2"]]
    assert shares[-1] == pytest.approx([0.5, 0.3, 0.2], abs=1 / 48)  # 48 sequences: within one of each share


@pytest.mark.parametrize(
    "name", ["qwen3_tied_pp2_zbv_resumed", "qwen3_tied_fsdp4_resumed", "ds_mtp_pp2_resumed", "ds_mtp_fsdp4_resumed"]
)
def test_tied_embeddings_resume_between_pipelined_and_unsplit_layouts(runs, name):
    # One process -> PP 2 (both copies on one rank) and PP 2 -> FSDP 4: the copies' optimizer state
    # is stored under the canonical name, so the resumed steps continue the single process's. The
    # same for the input embedding that MTP's last stage borrows (one name on both stages).
    ref, got = runs["qwen3_tied_single" if name.startswith("qwen3") else "ds_mtp_single"], runs[name]
    assert [r["step"] for r in got] == [4, 5, 6]
    for r, g in zip(ref[3:], got):
        assert abs(r["loss"] - g["loss"]) < FP32_TOL, f"{name} step {g['step']}: {g['loss']} vs {r['loss']}"


@pytest.mark.parametrize("name", ["bc_cp2_ulysses_from_ring", "bc_cp2_ring_from_ulysses"])
def test_context_parallel_methods_resume_each_other(runs, name):
    # A ring CP 2 save at step 3 resumed under Ulysses CP 2, and the reverse: the model and optimizer state
    # do not depend on the method, so steps 4-6 continue the single process's.
    ref, got = runs["bc_single"], runs[name]
    assert [r["step"] for r in got] == [4, 5, 6]
    for r, g in zip(ref[3:], got):
        assert abs(r["loss"] - g["loss"]) < FP32_TOL, f"{name} step {g['step']}: {g['loss']} vs {r['loss']}"


def test_block_causal_changes_the_loss(runs):
    # Same weights and data at step 1: masking documents from each other and leaving the labels
    # across them out changes the loss (by 0.03 to 0.1 here); the sliding window changes Qwen3's.
    assert abs(losses(runs["bc_single"])[0] - losses(runs["sd_causal_single"])[0]) > 1e-3


def hand_loss(tmp) -> tuple[float, float]:
    """Step 1's loss by hand, from the first global batch and the initial weights of one process: the
    model run on each document alone (no mask: a document is the whole sequence), per-token
    log-softmax, the labels after an EOS left out, the sum over the rest divided by their count. Also
    the mean over every label of the same run (what counting every label would give)."""
    from torchtitan.components.data import build_dataloader
    from torchtitan.config import load_config
    from torchtitan.models.registry import get_model_spec

    cfg = load_config(TINY + block_causal_args(tmp) + ["--training.local_batch_size", "8"])
    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    inputs, labels = next(iter(build_dataloader(cfg.training, tokenizer, 0, 1, 8)))
    spec = get_model_spec("llama3")
    args = spec.args_for_training("debugmodel", tokenizer.vocab_size, 64)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.training.seed)
    total, count, every = 0.0, 0, []
    with torch.no_grad():
        for row_in, row_lab in zip(inputs, labels):
            ends = (row_in == tokenizer.eos_id).nonzero().flatten().tolist()
            for start, stop in zip([0] + [e + 1 for e in ends], ends + [len(row_in) - 1]):
                doc = row_in[start : stop + 1]
                if len(doc) == 0:
                    continue
                logp = torch.log_softmax(model(doc[None]).double()[0], dim=-1)
                nll = -logp.gather(1, row_lab[start : stop + 1, None]).flatten()
                keep = doc != tokenizer.eos_id
                total += nll[keep].sum().item()
                count += int(keep.sum())
                every += nll.tolist()
    return total / count, sum(every) / len(every)


def test_ignored_labels_loss_is_the_hand_computed_one(runs):
    expected, counting_all = hand_loss(runs["_tmp"])
    assert abs(expected - counting_all) > 1e-3  # the left-out labels matter
    for name in ("bc_single", "bc_fsdp2_accum2", "bc_cp2_allgather"):
        got = losses(runs[name])[0]
        assert abs(got - expected) < FP32_TOL, f"{name}: step-1 loss {got}, by hand {expected}"
