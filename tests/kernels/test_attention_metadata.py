"""AttentionMetadata.for_chunks: its Python-list path (few tokens) and its vectorised path give the same metadata."""

import torch
from hypothesis import given, settings, strategies as st

from draftsmith.kernels.attention import LIST_METADATA_MAX_TOKENS, AttentionMetadata

BLOCK_SIZE = 4


@st.composite
def chunks(draw):
    """Per sequence: a chunk of new tokens after a cached start, and a block table (distinct, shuffled blocks)
    with room for both (sometimes a spare block past the end, as lookahead reservations leave)."""
    num_seqs = draw(st.integers(1, 6))
    query_lens = draw(st.lists(st.integers(1, 12), min_size=num_seqs, max_size=num_seqs))
    starts = draw(st.lists(st.integers(0, 30), min_size=num_seqs, max_size=num_seqs))
    need = [-(-(s + q) // BLOCK_SIZE) + draw(st.integers(0, 1)) for s, q in zip(starts, query_lens)]
    blocks = draw(st.permutations(range(sum(need))))
    tables, at = [], 0
    for n in need:
        tables.append(list(blocks[at:at + n]))
        at += n
    return query_lens, starts, tables


@settings(max_examples=60, deadline=None)
@given(chunks())
def test_list_and_vectorised_paths_agree(batch):
    query_lens, starts, tables = batch
    assert sum(query_lens) <= LIST_METADATA_MAX_TOKENS   # so for_chunks takes the list path here
    listed, listed_pos = AttentionMetadata.for_chunks(query_lens, starts, tables, BLOCK_SIZE)
    vector, vector_pos = AttentionMetadata._for_chunks_vectorised(query_lens, starts, tables, BLOCK_SIZE, "cpu")
    assert torch.equal(listed_pos, vector_pos) and listed_pos.dtype == torch.int64
    for name in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(listed, name), getattr(vector, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (listed.max_seqlen_q, listed.max_seqlen_k) == (vector.max_seqlen_q, vector.max_seqlen_k)
    # and the slots are where the block tables put each position
    expected = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for i, (s, q) in enumerate(zip(starts, query_lens)) for p in range(s, s + q)]
    assert listed.slot_mapping.tolist() == expected


def test_a_chunk_past_the_list_path_gets_its_positions_and_slots():
    query_lens, starts = [LIST_METADATA_MAX_TOKENS + 1], [3]
    tables = [list(range(-(-(3 + LIST_METADATA_MAX_TOKENS + 1) // BLOCK_SIZE)))]
    meta, positions = AttentionMetadata.for_chunks(query_lens, starts, tables, BLOCK_SIZE)
    assert positions.tolist() == list(range(3, 3 + LIST_METADATA_MAX_TOKENS + 1))
    assert meta.slot_mapping.tolist() == positions.tolist()   # blocks 0, 1, 2, ... in order
