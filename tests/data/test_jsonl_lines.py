"""Cutting input into blocks of whole lines (reader side) and splitting them into lines (worker side)."""
import io
import random

from megatron_lite.data.jsonl import line_blocks, split_lines


def text_mode_lines(data: bytes):
    """Lines as Python's text mode reads them (Megatron-LM's preprocessing reads so), without their endings."""
    return [line.rstrip("\n") for line in io.TextIOWrapper(io.BytesIO(data), encoding="latin-1", newline=None)]


def reads(data: bytes, rng: random.Random):
    """data in reads of random sizes, as a file or a decompressor returns it."""
    position = 0
    while position < len(data):
        size = rng.choice([1, 2, 3, 7, 64, 1000])
        yield data[position:position + size]
        position += size


def random_input(rng: random.Random) -> bytes:
    return bytes(rng.choice(b"ab\n\n\r") for _ in range(rng.randrange(0, 300)))


def random_cases(seed: int, count: int = 500):
    """(input, its blocks, max_lines, max_bytes) for random inputs, reads and limits."""
    rng = random.Random(seed)
    for _ in range(count):
        data = random_input(rng)
        max_lines, max_bytes = rng.randrange(1, 6), rng.randrange(1, 40)
        yield data, list(line_blocks(reads(data, rng), max_lines, max_bytes)), max_lines, max_bytes


def test_blocks_of_any_reads_split_into_the_lines_text_mode_reads():
    for data, blocks, _, _ in random_cases(0):
        assert b"".join(blocks) == data
        assert [line.decode("latin-1") for block in blocks for line in split_lines(block)] == text_mode_lines(data)


def test_every_block_but_the_last_ends_a_line_and_ends_at_max_lines_or_the_first_line_end_past_max_bytes():
    for data, blocks, max_lines, max_bytes in random_cases(1):
        for block in blocks[:-1]:
            assert block.endswith(b"\n")
        for block in blocks:
            assert 1 <= block.count(b"\n") + (not block.endswith(b"\n")) <= max_lines
            before_last_line = block.rfind(b"\n", 0, len(block) - 1) + 1
            assert before_last_line < max_bytes


def test_a_block_is_cut_as_soon_as_it_holds_max_lines_whole_lines():
    data = b"".join(b"%d\n" % i for i in range(10))
    assert list(line_blocks([data], 3, 1 << 20)) == [b"0\n1\n2\n", b"3\n4\n5\n", b"6\n7\n8\n", b"9\n"]
    assert list(line_blocks([b"abc", b"def", b"\ngh"], 3, 1 << 20)) == [b"abcdef\ngh"]


def test_an_empty_line_is_a_line_and_empty_input_has_none():
    assert split_lines(b"\n") == [b""]
    assert split_lines(b"") == []
    assert split_lines(b"a\r\nb\rc") == [b"a", b"b", b"c"]
