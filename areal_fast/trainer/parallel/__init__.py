"""The trainer's ranks past data parallelism: the device mesh (``mesh.py``), expert parallelism
(``expert.py``) and context parallelism (docs/parallelism.md)."""

from areal_fast.trainer.parallel.mesh import TrainerMesh, build_mesh, layout

__all__ = ["TrainerMesh", "build_mesh", "layout"]
