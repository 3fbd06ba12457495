"""Tiny random Hugging Face models for tests and benchmarks (nothing is downloaded), and the Hugging
Face references they are checked against (greedy ids, log-probs).

(The warm start's tiny model of the command-line runs is ``data/warm_start.py``'s: a recipe with its
tokenizer and a supervised start; these are random weights at a size a test picks.)"""

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


def build_tiny_qwen3_moe(path: str, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                         vocab_size: int = 256, num_heads: int = 2, num_kv_heads: int = 1,
                         num_experts: int = 4, num_experts_per_tok: int = 2, moe_intermediate_size: int = 32,
                         max_position_embeddings: int = 512, eos_token_id: int = 1,
                         tie_word_embeddings: bool = False) -> str:
    """Save a randomly initialised Qwen3-MoE causal LM (every block sparse, fp32 safetensors in the
    checkpoint layout: one tensor per expert and projection) to ``path``. Head size 32 (vLLM's CPU
    attention serves it)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, decoder_sparse_step=1, norm_topk_prob=True,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id, bos_token_id=0, pad_token_id=0, tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # as build_tiny_qwen2; the router too, so tokens spread over the experts
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


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain ``model.generate`` greedy continuation of ``prompt`` for exactly ``n`` tokens (EOS ignored)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of ``output`` tokens from one fresh forward pass (T < 1e-6: T = 1)."""
    import torch

    t = 1.0 if temperature < 1e-6 else temperature
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()


def load_hf(path: str, state_dict: dict | None = None):
    """The checkpoint at ``path`` in fp32 eval mode, optionally with ``state_dict`` loaded over it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    return model


def save_state_dict(state_dict: dict, src_path: str, dst_path: str) -> str:
    """A checkpoint dir at ``dst_path``: config of ``src_path`` + ``state_dict`` as model.safetensors."""
    import os
    import shutil

    from safetensors.torch import save_file

    os.makedirs(dst_path, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src_path, f)):
            shutil.copy(os.path.join(src_path, f), dst_path)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(dst_path, "model.safetensors"))
    return dst_path
