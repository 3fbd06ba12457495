"""SGLang's Qwen2ForCausalLM with delta weight updates (see areal_fast.backends.sglang.delta).

``EntryClass`` is built when SGLang's registry asks for it, so this module imports without SGLang."""

from areal_fast.backends.sglang.delta import delta_model_class


def __getattr__(name: str):
    if name == "EntryClass":
        cls = globals()["EntryClass"] = delta_model_class("sglang.srt.models.qwen2", "Qwen2ForCausalLM")
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
