"""How `kiln serve --replicas N` runs its cluster (no Ray import: the CLI reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int = 1
    ray_address: str | None = None  # None: start a local Ray cluster on this machine
    imbalance: int = 4  # a prefix match may load its replica this many requests past the least
    app_name: str = "kiln"  # the Serve application (one per ingress on a shared cluster)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas} must be at least 1")
        if self.imbalance < 0:
            raise ValueError(f"imbalance {self.imbalance} must be >= 0")


class ClusterError(RuntimeError):
    """A cluster the replicas cannot run on as asked; the message is for the user."""
