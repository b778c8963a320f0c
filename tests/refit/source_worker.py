"""A NIXL source process for the tests: one ShardSource per simulated rank, all in one process.

Started with multiprocessing's spawn context; it sends the merged manifest of version 1 over
`conn`, then for each (version, seed) received refreshes every shard in place and sends the new
manifest; None or a closed pipe ends it. seed None leaves the buffers zeroed (fast, for big
buffers whose content does not matter).
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from refit_sidecar.core.manifest import (
    merge_manifests,
)
from refit_sidecar.publish.shard_source import ShardSource, SourceConfig
from refit_sidecar.publish.shard_specs import ShardSpec
from tests.refit.shards import random_global, shard_of


def serve(
    conn: Connection, ranks: list[tuple[SourceConfig, list[ShardSpec]]], seed: int | None
) -> None:
    sources = [(ShardSource.create(config, specs), specs) for config, specs in ranks]

    def publish(version: int, seed: int | None) -> None:
        for source, specs in sources:
            for spec in specs:
                if seed is not None:
                    full = random_global(spec.parameter, spec.shape, spec.dtype, seed)
                    source.write(spec.parameter, shard_of(full, spec))
        conn.send(merge_manifests(s.manifest(version) for s, _ in sources))

    publish(1, seed)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        publish(*message)
    for source, _ in sources:
        source.close()
