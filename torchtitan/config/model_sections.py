"""The sections of the model: which one is built, the overrides of its mixture of experts, and what is applied
to its blocks (float8 conversion, activation checkpointing)."""

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.fields import broken_rules, option


@dataclass(frozen=True)
class Model:
    name: str = option(
        "llama3",
        "Model family: one that ships with torchtitan (listed here from torchtitan/models/registry.py) or one "
        "registered by the module named in experimental.custom_import.",
    )
    flavor: str = option("debugmodel", "Size of the model family (a key of its flavors table).")
    tokenizer_path: str = option(
        "./assets/tokenizer/python_stdlib_4k.model",
        "A Hugging Face tokenizer folder or tokenizer.json, a tiktoken BPE file or a sentencepiece model (told "
        "apart by content); the model's vocabulary is its size, padded to a multiple of 64.",
    )
    converters: list[str] = option(
        [], "Model conversions applied before parallelizing: 'float8' (torchao float8 linear layers, see [float8])."
    )
    print_after_conversion: bool = option(False, "Print the model's modules after the converters ran.")
    hf_assets_path: str | None = option(
        None,
        "A Hugging Face model folder; read as the weights of checkpoint.initial_load_in_hf when "
        "checkpoint.initial_load_path is unset (the tokenizer comes from model.tokenizer_path).",
    )
    attn_mask_type: Literal["causal", "block_causal"] = option(
        "causal",
        "causal: a token attends to every earlier token of its training window; block_causal: only to the earlier "
        "tokens of its own document (documents end at the EOS the data pipeline writes after each).",
    )
    attn_backend: Literal["auto", "sdpa", "split", "flex"] = option(
        "auto",
        "The attention kernel. sdpa: scaled_dot_product_attention (with a boolean mask when the mask is more than "
        "causal); split: one causal SDPA call per document; flex: FlexAttention with a block mask, compiled (CUDA "
        "only: torch has no FlexAttention backward on CPU); auto: flex on CUDA for block_causal or sliding windows, "
        "sdpa otherwise. Context parallel uses its own ring attention, with the same mask.",
    )
    use_flex_attn: bool = option(False, "The reference schema's spelling of attn_backend = 'flex'.")
    sliding_window: int | None = option(
        None,
        "Sliding-window attention for families that have it (qwen3): layers max_window_layers and later attend to "
        "the last sliding_window positions only. Unset: the flavor's (none).",
    )
    max_window_layers: int | None = option(
        None, "The first layer with a sliding window (the layers before it attend fully). Unset: the flavor's (0)."
    )
    mtp_depth: int | None = option(
        None,
        "Multi-token prediction for families that have it (deepseek_v3): this many modules after the last layer, "
        "module k predicting the token k + 1 positions ahead. 0: off. Unset: the flavor's (0).",
    )
    delta_rule_kernel: Literal["torch", "fla"] | None = option(
        None,
        "The gated delta rule's kernel for families that have it (qwen3_5): torch, the project's chunked rule in "
        "PyTorch (every device; the reference); fla, flash-linear-attention's Triton kernel (training on CUDA; needs "
        "pip install flash-linear-attention). Unset: the flavor's (torch).",
    )
    mtp_loss_weight: float | None = option(
        None, "The weight of the multi-token-prediction modules' mean loss in the gradient. Unset: the flavor's (0.3)."
    )

    def check(self) -> list[str]:
        return broken_rules(
            (
                self.sliding_window is None or self.sliding_window > 0,
                f"model.sliding_window must be a positive number of positions, got {self.sliding_window}; leave it "
                f"unset for attention over every earlier position",
            ),
            (
                self.max_window_layers is None or self.max_window_layers >= 0,
                f"model.max_window_layers must be 0 or more, got {self.max_window_layers}",
            ),
            (
                self.mtp_depth is None or self.mtp_depth >= 0,
                f"model.mtp_depth must be 0 (no multi-token prediction) or more, got {self.mtp_depth}",
            ),
            (
                self.mtp_loss_weight is None or self.mtp_loss_weight >= 0,
                f"model.mtp_loss_weight must be 0 or more, got {self.mtp_loss_weight}",
            ),
            (
                not self.use_flex_attn or self.attn_backend in ("auto", "flex"),
                f"model.use_flex_attn = true asks for FlexAttention but model.attn_backend = {self.attn_backend!r}; "
                f"keep one",
            ),
        ) + [
            f"model.converters: unknown converter {c!r}; the only one is 'float8'"
            for c in self.converters
            if c != "float8"
        ]


@dataclass(frozen=True)
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = option(
        "none",
        "Recompute activations in backward instead of keeping them: none, full (every block), or "
        "selective (see selective_ac_option).",
    )
    selective_ac_option: str = option(
        "2",
        "With mode = selective: a positive integer N checkpoints every N-th block; 'op' keeps the outputs "
        "of attention and of every other matmul in each block and recomputes the rest.",
    )

    def check(self) -> list[str]:
        ac_option = self.selective_ac_option
        return broken_rules(
            (
                self.mode != "selective" or ac_option == "op" or (ac_option.isdigit() and int(ac_option) > 0),
                f"activation_checkpoint.selective_ac_option must be a positive integer (checkpoint every N-th block) "
                f"or 'op' (operator-level policy), got {ac_option!r}",
            )
        )


@dataclass(frozen=True)
class Float8:
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = option(
        "tensorwise", "torchao float8 recipe: one scale per tensor, or per row (rowwise needs CUDA kernels for speed)."
    )
    enable_fsdp_float8_all_gather: bool = option(
        False, "All-gather FSDP parameters in float8 (tensorwise recipe only): half the bytes of bf16."
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = option(
        False, "Compute all float8 weight scales in one fused step after the optimizer (with float8 all-gather)."
    )
    filter_fqns: list[str] = option(
        ["output"], "Linear layers whose name contains any of these stay in high precision."
    )
    emulate: bool = option(False, "Emulate float8 matmuls in high precision (for testing on hardware without float8).")

    def check(self) -> list[str]:
        return broken_rules(
            (
                not self.precompute_float8_dynamic_scale_for_fsdp or self.enable_fsdp_float8_all_gather,
                "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather = true",
            )
        )


@dataclass(frozen=True)
class MoE:
    top_k: int | None = option(
        None, "Experts per token (unset: the flavor's); changes the model's compute, not its weights."
    )
    load_balance_coeff: float | None = option(
        None,
        "Update rate of the auxiliary-loss-free expert bias (moved after every step toward equal expert loads); "
        "0 turns the bias off. Unset: the flavor's (1e-3 for Qwen3-MoE).",
    )
    seq_aux_loss_coeff: float | None = option(
        None, "Coefficient of the sequence-wise load-balancing auxiliary loss (0: off). Unset: the flavor's (0)."
    )
    z_loss_coeff: float | None = option(None, "Coefficient of the router z-loss (0: off). Unset: the flavor's (0).")
    capacity_factor: float | None = option(
        None,
        "Each expert keeps at most capacity_factor x tokens x top_k / experts assignments per micro-batch, the "
        "highest-scored; the rest are dropped (their share is reported). 0: no limit. Unset: the flavor's (no limit).",
    )

    def check(self) -> list[str]:
        problems = [
            f"moe.{key} must be 0 (off) or more, got {getattr(self, key)}"
            for key in ("load_balance_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "capacity_factor")
            if not (getattr(self, key) is None or getattr(self, key) >= 0)
        ]
        return problems + broken_rules(
            (self.top_k is None or self.top_k >= 1, f"moe.top_k must be 1 or more, got {self.top_k}")
        )
