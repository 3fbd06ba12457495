"""The example tasks, workflows and agents that the shipped ``examples/*.yaml`` runs name
(``module:function`` strings): a multi-turn task, a tool-calling task, and agents written with the
OpenAI SDK. They sit above the workflow and agent packages they use (docs/workflows.md, docs/agents.md).
"""
