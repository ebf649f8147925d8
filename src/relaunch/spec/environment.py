"""R-07: the environment MindCluster's operator injects for process-level recovery. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from relaunch.spec.settings import RecoverySettings
from relaunch.spec.vocabulary import Framework, RecoverStrategy

__all__ = ["process_recovery_env"]

# ---------------------------------------------------------------------------------------------
# the environment MindCluster's operator injects for process-level recovery (seed 004,
# Table 3). Several strategies merge: flags are ORed, HIGH_AVAILABILITY lists every value in
# R-36 order, MS_ENABLE_TFT lists every feature.
# ---------------------------------------------------------------------------------------------

_PYTORCH_ENV: Final[Mapping[RecoverStrategy, Mapping[str, str]]] = {
    RecoverStrategy.RECOVER: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "HIGH_AVAILABILITY": "recover",
    },
    RecoverStrategy.RETRY: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "HIGH_AVAILABILITY": "retry",
    },
    RecoverStrategy.RECOVER_IN_PLACE: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "ENABLE_RESTART_FAULT_PROCESS": "on",
        "HIGH_AVAILABILITY": "recover",
    },
    RecoverStrategy.ELASTIC_TRAINING: {
        "PROCESS_RECOVER": "on",
        "HIGH_AVAILABILITY": "elastic-training",
    },
    RecoverStrategy.DUMP: {
        "PROCESS_RECOVER": "on",
        "ELASTIC_PROCESS_RECOVER_ENABLE": "1",
        "HIGH_AVAILABILITY": "dump",
    },
}

_MINDSPORE_TFT: Final[Mapping[RecoverStrategy, tuple[str, ...]]] = {
    RecoverStrategy.RECOVER: ("ARF",),
    RecoverStrategy.RETRY: ("UCE", "HCCE"),
    RecoverStrategy.RECOVER_IN_PLACE: ("ARF",),
    RecoverStrategy.DUMP: ("TTP",),
}


def process_recovery_env(recovery: RecoverySettings) -> dict[str, str]:
    """The variables of seed 004 Table 3 for this job's strategies and pod-rescheduling (R-07)."""
    env: dict[str, str] = {}
    strategies = recovery.recover_strategies if recovery.process_level_asked else ()
    if recovery.framework is Framework.PYTORCH:
        ha: list[str] = []
        for strategy in strategies:
            for name, value in _PYTORCH_ENV.get(strategy, {}).items():
                if name == "HIGH_AVAILABILITY":
                    if value not in ha:
                        ha.append(value)
                else:
                    env[name] = value
        if ha:
            env["HIGH_AVAILABILITY"] = ",".join(ha)
        return env
    features: list[str] = []
    for strategy in strategies:
        if strategy in _MINDSPORE_TFT:
            env.update(
                PROCESS_RECOVER="on", ELASTIC_PROCESS_RECOVER_ENABLE="1", MINDIO_FOR_MINDSPORE="1"
            )
            if strategy is RecoverStrategy.RECOVER_IN_PLACE:
                env["ENABLE_RESTART_FAULT_PROCESS"] = "on"
            features.extend(f for f in _MINDSPORE_TFT[strategy] if f not in features)
    if recovery.pod_reschedule:
        features.append("RSC")
    if features:
        env["MS_ENABLE_TFT"] = "{" + ",".join(f"{f}:1" for f in features) + "}"
    return env
