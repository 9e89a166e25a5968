"""Resolving many names resolves each folder once and each file's own link: the same paths as
realpath, and a file linked out of the allowed prefixes is still refused."""

import os

import pytest

from disttrain_api.errors import PermissionDenied
from preprocess_service.adapters.io.sources import ShardPolicy, resolve


def test_names_resolve_as_realpath_does_through_folder_and_file_links(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(5):
        (data / f"{i:03d}.tar").write_bytes(b"")
    os.symlink(data, tmp_path / "alias")  # a linked folder
    os.symlink(data / "001.tar", data / "005.tar")  # a linked file inside it
    policy = ShardPolicy(allowed_prefixes=(str(tmp_path),))
    names = [str(tmp_path / "alias" / f"{i:03d}.tar") for i in range(6)]
    got = [s.location for s in resolve([str(tmp_path / "alias" / "{000..005}.tar")], policy)]
    assert got == [os.path.realpath(n) for n in names]
    assert got[5] == str(data / "001.tar")


def test_a_file_linked_out_of_the_allowed_prefix_is_refused(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.tar").write_bytes(b"")
    (allowed / "000.tar").write_bytes(b"")
    os.symlink(outside / "secret.tar", allowed / "001.tar")
    policy = ShardPolicy(allowed_prefixes=(str(allowed),))
    assert len(resolve([str(allowed / "000.tar")], policy)) == 1
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        resolve([str(allowed / "{000..001}.tar")], policy)
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        resolve([str(allowed)], policy)  # the folder's *.tar files, one of them a link out
