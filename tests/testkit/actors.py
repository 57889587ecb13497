"""What actors this driver's job has made, read from Ray's GCS (no dashboard needed)."""
from __future__ import annotations


def actors_made(class_name: str) -> int:
    """How many actors of `class_name` this process's Ray job has made so far, dead ones included
    (a run's controller makes its actors in the driver's job)."""
    import ray
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return sum(1 for actor in state.actors(job_id=job).values() if actor["ActorClassName"] == class_name)
