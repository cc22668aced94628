"""Launchers: what started this process (detect, rank, run dir name, requeue) and how to start a run
elsewhere (``slurm``: sbatch scripts; ``local``: N ranks on this machine). May import only
``shardlight.errors`` and itself: it sits below everything that runs a rank."""

from __future__ import annotations

from typing import List, Mapping

from shardlight.launch.launchers import Launcher, LightningLauncher, LocalLauncher, TorchrunLauncher
from shardlight.launch.slurm import SlurmLauncher

# Most specific first; ``local`` always matches. A new launcher: one file, one line here.
LAUNCHERS: List[Launcher] = [SlurmLauncher(), TorchrunLauncher(), LightningLauncher(), LocalLauncher()]


def detect_launcher(env: Mapping[str, str]) -> Launcher:
    return next(launcher for launcher in LAUNCHERS if launcher.detect(env))


def launcher_named(name: str) -> Launcher:
    return next((launcher for launcher in LAUNCHERS if launcher.name == name), LocalLauncher())


__all__ = ["LAUNCHERS", "Launcher", "detect_launcher", "launcher_named"]
