"""Damaged Hugging Face weight files: ``load_pretrained`` refuses each with a psrt error naming
the file (and the tensor at fault), and changes no tensor of the model, even when the damaged
file is the second of two."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from psrt.checkpoint import files as checkpoint_files
from psrt.errors import InvalidArgumentError
from psrt.pretrained import INDEX, RECORDS, load_pretrained, write_index


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.lm_head = nn.Linear(5, 7, bias=False)


def saved(directory, *, records: bool) -> dict[str, torch.Tensor]:
    """Two weight files and their index (with psrt's records of them, or none, as transformers
    writes it); returns what they hold."""
    torch.manual_seed(1)
    model = Tiny()
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    parts = []
    for file, names in (("model-00001-of-00002.safetensors", ["body.weight", "body.bias"]),
                        ("model-00002-of-00002.safetensors", ["lm_head.weight"])):
        tensors = {name: state[name] for name in names}
        if records:
            record = checkpoint_files.write_safetensors(tensors, str(directory / file), {"format": "pt"})
            parts.append({"file": file, "record": record.to_json(),
                          "sizes": {n: t.numel() * t.element_size() for n, t in tensors.items()}})
        else:
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
            parts.append({"file": file, "sizes": {n: 0 for n in names}})
    if records:
        write_index(str(directory), parts)
    else:
        (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
            name: part["file"] for part in parts for name in part["sizes"]}}))
    return state


def rewrite_header(path, change) -> None:
    """Apply ``change`` to the file's JSON header and write it back, the data untouched."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = change(json.loads(raw[8:8 + length]))
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])


def as_f16(header):
    header["lm_head.weight"]["dtype"] = "F16"
    return header


def shifted(header):
    begin, end = header["lm_head.weight"]["data_offsets"]
    header["lm_head.weight"]["data_offsets"] = [begin + 4, end + 4]
    return header


def without_offsets(header):
    del header["lm_head.weight"]["data_offsets"]
    return header


def unknown_dtype(header):
    header["lm_head.weight"]["dtype"] = "F24"
    return header


def set_length(value):
    def damage(path):
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", value) + raw[8:])
    return damage


def as_list(path):
    path.write_bytes(struct.pack("<Q", 8) + b"[]      " + b"\0" * 16)


def truncated(path):
    path.write_bytes(path.read_bytes()[:-12])


CASES = {
    "dtype_f32_to_f16": (lambda p: rewrite_header(p, as_f16), r"tensor 'lm_head.weight': dtype F16 x shape \[7, 5\]"),
    "offsets_shifted_by_4": (lambda p: rewrite_header(p, shifted), r"tensor 'lm_head.weight': its data_offsets"),
    "header_length_2_40": (set_length(2 ** 40), "its header claims 1099511627776 bytes"),
    "header_length_2_63": (set_length(2 ** 63), "its header claims 9223372036854775808 bytes"),
    "header_length_2_64_minus_1": (set_length(2 ** 64 - 1), "its header claims 18446744073709551615 bytes"),
    "header_a_json_list": (as_list, "its header is a JSON list"),
    "no_data_offsets": (lambda p: rewrite_header(p, without_offsets), r"tensor 'lm_head.weight': its entry lacks"),
    "unknown_dtype": (lambda p: rewrite_header(p, unknown_dtype), "tensor 'lm_head.weight': unknown dtype 'F24'"),
    "data_cut_short": (truncated, "cut short"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_header_is_refused_naming_the_file_and_nothing_changes(tmp_path, case):
    saved(tmp_path, records=False)  # transformers' own files: no sha256 to check, the header must do
    damage, expected = CASES[case]
    second = tmp_path / "model-00002-of-00002.safetensors"
    damage(second)
    model = Tiny()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(InvalidArgumentError) as refused:
        load_pretrained(model, str(tmp_path))
    message = str(refused.value)
    assert str(second) in message and "not a valid safetensors file" in message, message
    assert __import__("re").search(expected, message), message
    for name, value in model.state_dict().items():  # the first file's tensors were not written either
        assert torch.equal(value, before[name]), f"{case}: {name} changed by a refused load"


def test_a_flipped_data_byte_is_refused_by_the_recorded_sha256_and_nothing_changes(tmp_path):
    saved(tmp_path, records=True)
    second = tmp_path / "model-00002-of-00002.safetensors"
    raw = bytearray(second.read_bytes())
    raw[-3] ^= 0x10  # inside lm_head.weight: the header still agrees with the data
    second.write_bytes(bytes(raw))
    model = Tiny()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(InvalidArgumentError, match=r"model-00002-of-00002.safetensors was modified after it was "
                                                   r"saved.*sha256 mismatch"):
        load_pretrained(model, str(tmp_path))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_psrt_records_each_file_in_the_index_and_a_good_load_is_exact(tmp_path):
    state = saved(tmp_path, records=True)
    index = json.loads((tmp_path / INDEX).read_text())
    assert sorted(index["metadata"][RECORDS]) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    model = Tiny()
    load_pretrained(model, str(tmp_path))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
