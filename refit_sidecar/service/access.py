"""Which roles may call each RefitService method (docs/security.md): the trainer's ranks
publish, receivers read and lease. A method missing here is refused to every caller; a test
checks that every RPC of the service is listed."""

from __future__ import annotations

from trainer_refit.auth import MethodRoles, Role, method_roles
from trainer_refit.v1 import refit_pb2

SERVICE = refit_pb2.DESCRIPTOR.services_by_name["RefitService"]

METHOD_ROLES: MethodRoles = method_roles(
    SERVICE,
    {
        "RegisterTrainer": [Role.TRAINER],
        "RenewRegistration": [Role.TRAINER],
        "ReserveSlot": [Role.TRAINER],
        "PublishShards": [Role.TRAINER],
        "GetLatestVersion": [Role.RECEIVER],
        "WatchVersions": [Role.RECEIVER],
        "GetManifest": [Role.RECEIVER],
        "GetChecksums": [Role.RECEIVER],
        "AcquireLease": [Role.RECEIVER],
        "RenewLease": [Role.RECEIVER],
        "ReleaseLease": [Role.RECEIVER],
        "GetSources": [Role.RECEIVER],
        "ReleaseSources": [Role.RECEIVER],
        "ListTree": [Role.RECEIVER],
    },
)
