"""The reproduction: paired training runs (standard, stabilized, fp32 control) on one batch order."""
from stableflash.repro.presets import REPRO_PRESETS, ReproPreset, default_preset
from stableflash.repro.run import run_repro

__all__ = ["REPRO_PRESETS", "ReproPreset", "default_preset", "run_repro"]
