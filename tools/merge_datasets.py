#!/usr/bin/env python3
"""Join the shards of a preprocess_data.py run into one .bin/.idx pair.

    python tools/merge_datasets.py --input data/shards/ --output-prefix data/pile_text_document

writes data/pile_text_document.{bin,idx,json}: the shards in shard order,
byte-identical to what one preprocess_data.py run over the whole input writes.
--input is a folder of shards (of one dataset), or shard prefixes or files
(`data/shards/pile_text_document.shard-*.idx`). Datasets that are not shards
(each with its sidecar .json) are concatenated in the order given.

Before anything is written, every input is checked against its sidecar and
the others: same tokenizer (model hash, vocabulary, eod) and dtype, every
shard index present once, shards of one run (same input listing), no
truncated .bin or .idx. A refusal names the flag and the file, exits 2 and
leaves the output untouched; the output appears under its final name only when
complete. An existing output is refused unless --overwrite.
"""
from __future__ import annotations

import argparse
import os
import re
import reprlib
import sys
import time
from typing import List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.atomic import WriteError  # noqa: E402
from megatron_lite.data.indexed_dataset import (  # noqa: E402
    IndexedDataset, IndexedDatasetError, data_file_path, index_file_path, merge_datasets,
)
from megatron_lite.data.sidecar import (  # noqa: E402
    SidecarError, describe_outputs, read_sidecar, remove_outputs, shard_prefix, sidecar_path, write_sidecar,
)
from megatron_lite.targets import OVERWRITE_HELP, target_problem  # noqa: E402

SHARD_NAME = re.compile(r"^(?P<dataset>.+)\.shard-(?P<index>\d+)-of-(?P<count>\d+)\.(?:bin|idx|json)$")
SUFFIXES = (".bin", ".idx", ".json")
RECORD_FIELDS = {"dataset": str, "dtype": str, "tokenizer": dict, "documents": int, "bad_lines": int,
                 "bin_bytes": int, "idx_bytes": int}
SHARD_FIELDS = {"index": int, "count": int, "input_fingerprint": str}
"""What the merge reads from each sidecar, and of what type."""


class Refusal(Exception):
    """An input that cannot be merged; the message names the file and the problem."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, nargs="+",
                   help="a folder of shards, or shard / dataset prefixes or their .bin/.idx/.json files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx/.json")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    return p


def input_prefixes(inputs: List[str]) -> List[str]:
    """Dataset prefixes named by --input, without duplicates, in the order given (a folder's shards by name)."""
    prefixes: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted({os.path.join(item, name[:-len(suffix)]) for name in os.listdir(item)
                            for suffix in SUFFIXES if name.endswith(suffix) and SHARD_NAME.match(name)})
            if not found:
                raise Refusal(f"--input {item}: no shards (*.shard-NNNNN-of-NNNNN.bin/.idx/.json) in this folder")
            datasets = sorted({SHARD_NAME.match(os.path.basename(p) + ".idx").group("dataset") for p in found})
            if len(datasets) > 1:
                raise Refusal(f"--input {item} holds shards of {len(datasets)} datasets ({', '.join(datasets)}); "
                              f"merge one at a time, e.g. --input {os.path.join(item, datasets[0])}.shard-*.idx")
            prefixes.extend(found)
            continue
        prefix = os.path.splitext(item)[0] if item.endswith(SUFFIXES) else item
        if not any(os.path.exists(prefix + s) for s in SUFFIXES):
            raise Refusal(f"--input {item}: no such dataset ({prefix}.bin/.idx/.json not found)")
        prefixes.append(prefix)
    return list(dict.fromkeys(prefixes))


def check_record(prefix: str, record: dict) -> None:
    """The sidecar holds the fields the merge reads, of their types: one edited by hand is named, not a
    traceback."""
    shard = record.get("shard")
    if shard is not None and not isinstance(shard, dict):
        raise Refusal(f"{sidecar_path(prefix)}: field 'shard' is {reprlib.repr(shard)}, not an object or null; "
                      f"rewrite the dataset with preprocess_data.py")
    fields = [(record, name, kind) for name, kind in RECORD_FIELDS.items()]
    if shard is not None:
        fields += [(shard, name, kind) for name, kind in SHARD_FIELDS.items()] + [(record, "json_key", str)]
    for holder, name, kind in fields:
        value = holder.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise Refusal(f"{sidecar_path(prefix)}: field {name!r} is {reprlib.repr(value)}, not a {kind.__name__}; "
                          f"rewrite the dataset with preprocess_data.py")


def check_pair(prefix: str, record: dict) -> IndexedDataset:
    """The pair is whole and is what its sidecar says it is."""
    for path, key in ((data_file_path(prefix), "bin_bytes"), (index_file_path(prefix), "idx_bytes")):
        if not os.path.isfile(path):
            raise Refusal(f"{path}: missing, though {sidecar_path(prefix)} records it")
        size = os.path.getsize(path)
        if size != record.get(key):
            raise Refusal(f"{path}: {size} bytes, but {sidecar_path(prefix)} records {record.get(key)} "
                          f"(truncated or overwritten; rerun that preprocess_data.py shard)")
    try:
        dataset = IndexedDataset(prefix)
    except IndexedDatasetError as e:
        raise Refusal(str(e)) from None
    if str(dataset.dtype) != record.get("dtype") or dataset.num_documents != record.get("documents"):
        raise Refusal(f"{index_file_path(prefix)}: {dataset.num_documents} documents of {dataset.dtype}, but "
                      f"{sidecar_path(prefix)} records {record.get('documents')} of {record.get('dtype')}")
    return dataset


def check_agreement(records: List[Tuple[str, dict]]) -> None:
    """Every input has the first one's tokenizer and dtype; shards are one complete run, in order."""
    first_prefix, first = records[0]
    for prefix, record in records[1:]:
        for field in ("dtype", "tokenizer"):
            if record.get(field) != first.get(field):
                raise Refusal(f"{sidecar_path(prefix)}: {field} {describe(record.get(field))} differs from "
                              f"{describe(first.get(field))} in {sidecar_path(first_prefix)}; merge only outputs "
                              f"of one tokenizer")
    shards = [(prefix, r["shard"]) for prefix, r in records if r.get("shard")]
    if not shards:
        return
    if len(shards) != len(records):
        plain = next(prefix for prefix, r in records if not r.get("shard"))
        raise Refusal(f"{sidecar_path(plain)}: not a shard, but other inputs are; merge shards of one run only")
    first_prefix, first_shard = shards[0]
    count, dataset = first_shard["count"], first["dataset"]
    seen = {}
    for (prefix, shard), (_, record) in zip(shards, records):
        for field, value in (("dataset", record["dataset"]), ("json_key", record["json_key"])):
            if value != first[field]:
                raise Refusal(f"{sidecar_path(prefix)}: {field} {value!r} differs from {first[field]!r} in "
                              f"{sidecar_path(first_prefix)}; merge shards of one run only")
        for field in ("count", "input_fingerprint"):
            if shard[field] != first_shard[field]:
                raise Refusal(f"{sidecar_path(prefix)}: shard {field} {shard[field]!r} differs from "
                              f"{first_shard[field]!r} in {sidecar_path(first_prefix)}; shards of another run "
                              f"(other --num-shards or another input)")
        if shard["index"] in seen:
            raise Refusal(f"{sidecar_path(prefix)}: shard {shard['index']} also given as {sidecar_path(seen[shard['index']])}")
        seen[shard["index"]] = prefix
    missing = sorted(set(range(count)) - set(seen))
    if missing:
        folder = os.path.dirname(first_prefix)
        names = ", ".join(shard_prefix(os.path.join(folder, dataset), i, count) + ".{bin,idx,json}"
                          for i in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise Refusal(f"--input: {len(missing)} of {count} shards missing: {names}{more}; run preprocess_data.py "
                      f"--num-shards {count} --shard-index {missing[0]} (and any other missing index) first")


def describe(value) -> str:
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {v}" for k, v in sorted(value.items())) + ")"
    return repr(value)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    problem = target_problem("--output-prefix", args.output_prefix, [args.output_prefix + s for s in SUFFIXES],
                             args.overwrite)
    if problem:
        print(f"merge_datasets.py: error: {problem}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        prefixes = input_prefixes(args.input)
        output = os.path.abspath(args.output_prefix)
        for prefix in prefixes:
            if os.path.abspath(prefix) == output:
                raise Refusal(f"--output-prefix {args.output_prefix} is also an input; choose another prefix")
        try:
            records = [(prefix, read_sidecar(prefix)) for prefix in prefixes]
        except SidecarError as e:
            raise Refusal(str(e)) from None
        for prefix, record in records:
            check_record(prefix, record)
        check_agreement(records)
        datasets = {prefix: check_pair(prefix, record) for prefix, record in records}
    except Refusal as e:
        message = str(e)  # every input problem is --input's: name the flag where the message does not
        print(f"merge_datasets.py: error: {message if message.startswith('--') else f'--input {message}'}",
              file=sys.stderr)
        return 2
    if records[0][1].get("shard"):
        records.sort(key=lambda item: item[1]["shard"]["index"])
    ordered = [prefix for prefix, _ in records]
    del datasets  # each input is reopened while it is copied; no memory map stays open meanwhile
    if os.path.exists(sidecar_path(args.output_prefix)):
        os.remove(sidecar_path(args.output_prefix))  # the new pair must never sit beside an old record
    first = records[0][1]
    bad_lines = sum(int(r.get("bad_lines", 0)) for _, r in records)
    try:
        merged = merge_datasets(args.output_prefix, ordered)
    except WriteError as e:
        print(f"merge_datasets.py: error: {e}; nothing was written", file=sys.stderr)
        return 1
    try:
        write_merged_sidecar(args.output_prefix, merged, records, ordered, bad_lines)
    except WriteError as e:
        remove_outputs(args.output_prefix)  # the pair this run published, now without its record
        print(f"merge_datasets.py: error: {e}; nothing was written", file=sys.stderr)
        return 1
    per_input = ", ".join(f"{os.path.basename(p)}: {r['bad_lines']}" for p, r in records if r.get("bad_lines"))
    kind = "shards" if first.get("shard") else "datasets"
    print(f"merged {len(ordered)} {kind} into {args.output_prefix}.{{bin,idx,json}}: {merged.num_documents} documents, "
          f"{len(merged)} sequences, {int(merged.sequence_lengths.sum(dtype='int64'))} tokens ({merged.dtype}); "
          f"{bad_lines} bad lines were skipped in preprocessing{f' ({per_input})' if per_input else ''}; "
          f"{time.perf_counter() - start:.1f}s")
    return 0


def write_merged_sidecar(output_prefix: str, merged, records, ordered, bad_lines: int) -> None:
    first = records[0][1]
    write_sidecar(output_prefix, {
        "dataset": os.path.basename(output_prefix),
        "json_key": first.get("json_key") if all(r.get("json_key") == first.get("json_key") for _, r in records)
        else None,
        "tokenizer": first["tokenizer"], "dtype": first["dtype"],
        "documents": merged.num_documents, "sequences": len(merged),
        "tokens": int(merged.sequence_lengths.sum(dtype="int64")), "bad_lines": bad_lines,
        "shard": None, "merged_from": [os.path.basename(p) for p in ordered],
        **describe_outputs(output_prefix),
    })


if __name__ == "__main__":
    sys.exit(main())
