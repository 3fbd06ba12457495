"""A dropped PPO actor frees its optimizer state at once, and its model at the next collection.

bench/bench_trainer.py builds one actor per variant in one process. The actor's LR scheduler held
the bound method ``actor._lr_factor``: a cycle actor -> scheduler -> actor that kept the whole
actor (model, gradients, AdamW state) alive after ``del actor`` until the cycle collector happened
to run, so the second variant could run out of device memory. With the collector off, reference
counting alone must now free the actor, its optimizer (the AdamW moments: 2x the parameters in
fp32) and its scheduler. The model itself sits in torch's own FSDP cycle (the module's hooks are
bound methods of its FSDP state, which holds the module), so it goes at the next ``gc.collect()``,
which the benchmark runs between variants.
"""

import gc
import weakref

from test_trainer_actor import actor_for, make_batch, tiny  # noqa: F401 - tiny is a fixture


def test_a_dropped_actor_is_freed_without_the_cycle_collector(tiny):  # noqa: F811
    path, _ = tiny
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        actor = actor_for(path)
        actor.train_batch(make_batch(8, seed=3))  # gradients and optimizer state exist too
        refs = {"actor": weakref.ref(actor), "optimizer": weakref.ref(actor.optimizer),
                "scheduler": weakref.ref(actor.scheduler)}
        model = weakref.ref(actor.model)
        del actor
        alive = sorted(name for name, r in refs.items() if r() is not None)
        assert alive == [], f"still alive after `del actor` with the cycle collector off: {alive}"
        gc.collect()
        assert model() is None, "the model outlived a collection"
    finally:
        if was:
            gc.enable()
