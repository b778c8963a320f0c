"""Which roles may call each TrainerService method (docs/security.md). A method missing here
is refused to every caller; a test checks that every RPC of the service is listed."""

from __future__ import annotations

from trainer_refit.auth import MethodRoles, Role, method_roles
from trainer_refit.v1 import trainer_pb2

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]

METHOD_ROLES: MethodRoles = method_roles(
    SERVICE,
    {
        "BeginTrainStep": [Role.ORCHESTRATOR],
        "TrainMicrobatch": [Role.ORCHESTRATOR],
        "FinishTrainStep": [Role.ORCHESTRATOR],
        "AbortTrainStep": [Role.ORCHESTRATOR],
        "Forward": [Role.ORCHESTRATOR],
        "SaveCheckpoint": [Role.ORCHESTRATOR],
        "LoadCheckpoint": [Role.ORCHESTRATOR],
        "ExportHF": [Role.ORCHESTRATOR],
        "GetStatus": [Role.ORCHESTRATOR],
        "SetReference": [Role.ORCHESTRATOR],
    },
)
