"""Tiny random Hugging Face models for tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations


def build_tiny_qwen2(path: str, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     vocab_size: int = 256, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 128, max_position_embeddings: int = 512,
                     eos_token_id: int = 1, tie_word_embeddings: bool = False) -> str:
    """Save a randomly initialised Qwen2 causal LM (fp32 safetensors, no tokenizer) to ``path``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, eos_token_id=eos_token_id, bos_token_id=0,
        pad_token_id=0, tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    # default init (std 0.02) gives nearly uniform next-token distributions; 0.2 makes greedy and
    # sampled outputs depend visibly on the weights, so weight-update tests can see a change
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def perturbed_state_dict(path: str, *, seed: int, scale: float = 0.2) -> dict:
    """The checkpoint at ``path`` with every matrix replaced by fresh noise (a clearly different policy)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if t.dim() >= 2:
            t = torch.randn(t.shape, generator=g) * scale
        out[name] = t
    return out
