"""SGLang's Qwen3ForCausalLM with delta weight updates (see areal_fast.weights.delta_sglang)."""

from areal_fast.weights.delta_sglang import delta_model_class

EntryClass = delta_model_class("sglang.srt.models.qwen3", "Qwen3ForCausalLM")
