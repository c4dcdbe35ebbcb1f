"""Client.images() and Client.remove_image(): the images of the client's stores (with an embedded agent, its home
store), listed as `dsec image ls` lists them and removed as `dsec image rm` removes them."""

from __future__ import annotations

import os
import subprocess

import pytest

import dsec
from binding_testlib import make_home, tool


@pytest.fixture(scope="module")
def home(short_tmp):
    path = make_home(os.path.join(short_tmp, "images-home"))
    subprocess.run([tool("dsec"), "--home", path, "image", "build", "pyt/extra:v1", "--parent", "busybox",
                    "--from", os.path.dirname(__file__), "-q"], check=True, capture_output=True, timeout=120)
    return path


def ls_json(home: str) -> list[dict]:
    import json
    out = subprocess.run([tool("dsec"), "--home", home, "image", "ls", "--json"], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return json.loads(out)


def test_images_of_the_embedded_agents_home_store(home):
    with dsec.Client(home=home, agent_args=["--backends", "null"]) as c:
        images = {i.reference: i for i in c.images()}
        assert {"busybox:latest", "pyt/extra:v1"} <= set(images)
        listed = {j["reference"].split("@")[0]: j for j in ls_json(home)}
        for ref, info in images.items():
            assert isinstance(info, dsec.ImageInfo)
            assert info.digest == listed[ref]["digest"] and info.digest.startswith("sha256:")
            assert info.size == listed[ref]["size"] and info.stored_size == listed[ref]["stored_size"]
            assert info.store == os.path.join(home, "store")
            assert info.created_at > 0 and info.source
        extra = images["pyt/extra:v1"]
        assert (extra.name, extra.tag) == ("pyt/extra", "v1")
        assert [layer.role for layer in extra.layers] == ["base", "task"]
        assert extra.layers[0].digest == images["busybox:latest"].layers[0].digest
        assert all(isinstance(layer, dsec.ImageLayerInfo) and layer.size > 0 and layer.stored_size > 0
                   for layer in extra.layers)
        assert extra.size == sum(layer.size for layer in extra.layers)
        assert extra.parent.startswith("busybox:latest@sha256:")
        assert "ImageInfo(reference='pyt/extra:v1'" in repr(extra)


def test_remove_image_as_dsec_image_rm(home):
    subprocess.run([tool("dsec"), "--home", home, "image", "build", "pyt/doomed", "--parent", "busybox",
                    "--from", os.path.dirname(__file__), "-q"], check=True, capture_output=True, timeout=120)
    with dsec.Client(home=home, agent_args=["--backends", "null"]) as c:
        c.create(image="pyt/doomed", kind="null", cpu=0.1).destroy()  # the client has resolved (cached) the tag
        c.remove_image("pyt/doomed")  # "latest" when no tag is given
        assert "pyt/doomed:latest" not in {i.reference for i in c.images()}
        assert "pyt/doomed:latest" not in {j["reference"].split("@")[0] for j in ls_json(home)}
        with pytest.raises(dsec.NotFound):
            c.create(image="pyt/doomed", kind="null", cpu=0.1)
        with pytest.raises(dsec.NotFound) as e:
            c.remove_image("pyt/doomed")
        assert isinstance(e.value, KeyError) and "pyt/doomed:latest" in str(e.value)
        with pytest.raises(dsec.InvalidArgument):
            c.remove_image("Not A Name")
        assert "busybox:latest" in {i.reference for i in c.images()}, "other images are left alone"


def test_images_of_configured_stores(agent, home):
    store = os.path.join(home, "store")
    with dsec.Client(endpoints=[agent.endpoint], stores=[store]) as c:
        assert {"busybox:latest", "pyt/extra:v1"} <= {i.reference for i in c.images()}
        assert all(i.store == store for i in c.images())


def test_a_client_without_stores_says_so(client):
    with pytest.raises(dsec.FailedPrecondition, match="no image stores"):
        client.images()
    with pytest.raises(dsec.FailedPrecondition):
        client.remove_image("busybox")
