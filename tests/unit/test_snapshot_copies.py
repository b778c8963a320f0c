"""How a snapshot slot's pieces are copied (`trainer_svc.runtime.snapshot_slot`)."""

from __future__ import annotations

import torch

from trainer_svc.runtime.snapshot_slot import FOREACH_FROM, copy_piece, piece_copies


def test_a_piece_of_many_regions_is_copied_in_its_widest_element_type() -> None:
    """`snapshot_slot.piece_copies`: a piece of many regions goes out as one `_foreach_copy_`,
    viewed in the widest element every region's size and address allow; a piece of few
    regions keeps its bytes (each a memcpy); the copy lands every byte either way."""
    source = torch.arange(1024, dtype=torch.uint8)
    target = torch.zeros(1024, dtype=torch.uint8)
    many = [(slice(64 * i, 64 * i + 48)) for i in range(FOREACH_FROM)]
    for cut, dtype in ((many, torch.int64), ([slice(2, 8), *many[1:]], torch.int16)):
        target.zero_()
        destinations, sources = piece_copies([target[c] for c in cut], [source[c] for c in cut])
        assert {t.dtype for t in (*destinations, *sources)} == {dtype}
        copy_piece(destinations, sources, non_blocking=False)
        for c in cut:
            assert torch.equal(target[c], source[c])
    few = many[:2]
    destinations, sources = piece_copies([target[c] for c in few], [source[c] for c in few])
    assert destinations[0].dtype == torch.uint8
