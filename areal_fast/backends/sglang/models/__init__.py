"""SGLang's external model package for delta weight updates (``areal_fast.backends.sglang.delta``):

    SGLANG_EXTERNAL_MODEL_PACKAGE=areal_fast.backends.sglang.models python -m sglang.launch_server ...

SGLang imports every module here and registers its ``EntryClass`` under the class name, replacing
its own model of that architecture. Importing a module imports SGLang: nothing else imports them.
"""
