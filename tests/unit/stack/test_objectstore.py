"""The broker's object store speaks S3 as tansu's client needs it: conditional puts, 304/412, listings, restarts."""

from __future__ import annotations

import hashlib
import threading
import time
import tracemalloc
from pathlib import Path
from xml.etree import ElementTree

import httpx
import pytest

from agentstream.stack.objectstore import ObjectStoreServer, S3Error
from tests.support.http_thread import ServerThread

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class Store:
    """An object store on a free port over ``root``, and a client for its one bucket ``b``."""

    def __init__(self, root: Path) -> None:
        self.server = ObjectStoreServer(root, ["b"])
        self.thread = ServerThread(self.server.app)
        self.client = httpx.Client(base_url=self.thread.url + "/b/", timeout=10)

    def stop(self) -> None:
        self.client.close()
        self.thread.stop()
        self.server.close()


@pytest.fixture
def store(tmp_path: Path):
    running = Store(tmp_path / "data")
    yield running
    running.stop()


def etag_of(body: bytes) -> str:
    return '"' + hashlib.md5(body).hexdigest() + '"'


def error_code(response: httpx.Response) -> str:
    return ElementTree.fromstring(response.content).findtext("Code") or ""


def listing(store: Store, **params: str) -> ElementTree.Element:
    response = store.client.get("", params={"list-type": "2", **params})
    assert response.status_code == 200, response.text
    return ElementTree.fromstring(response.content)


def test_put_get_head_and_delete_like_s3(store: Store, tmp_path: Path):
    put = store.client.put("clusters/c/topics/t/00000000000000000000.batch", content=b"batch-0")
    assert put.status_code == 200 and put.headers["ETag"] == etag_of(b"batch-0")
    got = store.client.get("clusters/c/topics/t/00000000000000000000.batch")
    assert got.content == b"batch-0" and got.headers["ETag"] == etag_of(b"batch-0")
    assert got.headers["Last-Modified"].endswith("GMT")
    head = store.client.head("clusters/c/topics/t/00000000000000000000.batch")
    assert head.status_code == 200 and head.headers["Content-Length"] == "7" and head.content == b""
    assert (tmp_path / "data/b/clusters/c/topics/t/00000000000000000000.batch").read_bytes() == b"batch-0"
    partial = store.client.get("clusters/c/topics/t/00000000000000000000.batch", headers={"Range": "bytes=2-4"})
    assert (partial.status_code, partial.content, partial.headers["Content-Range"]) == (206, b"tch", "bytes 2-4/7")
    assert store.client.delete("clusters/c/topics/t/00000000000000000000.batch").status_code == 204
    missing = store.client.get("clusters/c/topics/t/00000000000000000000.batch")
    assert (missing.status_code, error_code(missing)) == (404, "NoSuchKey")
    assert store.client.delete("never-was").status_code == 204
    assert store.client.head("no-such").status_code == 404
    other = httpx.get(store.thread.url + "/other/key")
    assert (other.status_code, error_code(other)) == (404, "NoSuchBucket")


def test_create_only_put_refuses_an_existing_key_with_412(store: Store):
    first = store.client.put("meta.json", content=b"v1", headers={"If-None-Match": "*"})
    assert first.status_code == 200
    again = store.client.put("meta.json", content=b"v2", headers={"If-None-Match": "*"})
    assert (again.status_code, error_code(again)) == (412, "PreconditionFailed")
    assert store.client.get("meta.json").content == b"v1"


def test_if_match_put_replaces_only_the_version_read(store: Store):
    missing = store.client.put("watermark.json", content=b"1", headers={"If-Match": etag_of(b"0")})
    assert (missing.status_code, error_code(missing)) == (404, "NoSuchKey")
    v1 = store.client.put("watermark.json", content=b"1").headers["ETag"]
    v2 = store.client.put("watermark.json", content=b"2", headers={"If-Match": v1})
    assert v2.status_code == 200 and v2.headers["ETag"] == etag_of(b"2")
    stale = store.client.put("watermark.json", content=b"3", headers={"If-Match": v1})
    assert (stale.status_code, error_code(stale)) == (412, "PreconditionFailed")
    assert store.client.get("watermark.json").content == b"2"


def test_conditional_get_answers_304_and_412(store: Store):
    etag = store.client.put("k", content=b"x").headers["ETag"]
    unchanged = store.client.get("k", headers={"If-None-Match": etag})
    assert (unchanged.status_code, unchanged.content, unchanged.headers["ETag"]) == (304, b"", etag)
    changed = store.client.get("k", headers={"If-None-Match": etag_of(b"older")})
    assert (changed.status_code, changed.content) == (200, b"x")
    wrong = store.client.get("k", headers={"If-Match": etag_of(b"older")})
    assert (wrong.status_code, error_code(wrong)) == (412, "PreconditionFailed")


def test_racing_writers_lose_no_update(store: Store):
    """Create-only puts race to one winner; read-modify-write with If-Match loses no increment."""
    created: list[int] = []
    store.client.put("counter", content=b"0")

    def writer(number: int) -> None:
        with httpx.Client(base_url=str(store.client.base_url), timeout=10) as client:
            if client.put("once", content=str(number).encode(), headers={"If-None-Match": "*"}).status_code == 200:
                created.append(number)
            for _ in range(10):
                while True:
                    current = client.get("counter")
                    value = int(current.content) + 1
                    answer = client.put("counter", content=str(value).encode(),
                                        headers={"If-Match": current.headers["ETag"]})
                    if answer.status_code == 200:
                        break
                    assert answer.status_code == 412

    threads = [threading.Thread(target=writer, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(created) == 1
    assert store.client.get("once").content == str(created[0]).encode()
    assert store.client.get("counter").content == b"80"


def test_list_objects_v2_prefix_delimiter_and_pages(store: Store):
    keys = [f"p/records/{n:020d}.batch" for n in range(7)] + ["p/groups/g1/0.json", "p/groups/g2/0.json",
                                                               "p/meta.json", "q/other"]
    for key in keys:
        store.client.put(key, content=key.encode())
    everything = listing(store)
    assert [e.text for e in everything.iter(f"{NS}Key")] == sorted(keys)
    contents = everything.find(f"{NS}Contents")
    assert contents is not None and contents.findtext(f"{NS}Size") == str(len(sorted(keys)[0]))
    assert (contents.findtext(f"{NS}LastModified") or "").endswith("Z")
    top = listing(store, prefix="p/", delimiter="/")
    assert [e.text for e in top.iter(f"{NS}Key")] == ["p/meta.json"]
    assert [e.findtext(f"{NS}Prefix") for e in top.iter(f"{NS}CommonPrefixes")] == ["p/groups/", "p/records/"]

    seen: list[str] = []
    token: str | None = None
    while True:
        paging = {"max-keys": "3", **({"continuation-token": token} if token else {})}
        page = listing(store, prefix="p/records/", **paging)
        seen += [e.text or "" for e in page.iter(f"{NS}Key")]
        if page.findtext(f"{NS}IsTruncated") == "false":
            break
        token = page.findtext(f"{NS}NextContinuationToken")
    assert seen == [key for key in keys if key.startswith("p/records/")]
    after = listing(store, prefix="p/records/", **{"start-after": "p/records/00000000000000000004.batch"})
    assert [e.text for e in after.iter(f"{NS}Key")] == [f"p/records/{n:020d}.batch" for n in (5, 6)]
    prefixes_paged = listing(store, prefix="p/", delimiter="/", **{"max-keys": "1"})
    token = prefixes_paged.findtext(f"{NS}NextContinuationToken")
    assert token is not None
    rest = listing(store, prefix="p/", delimiter="/", **{"continuation-token": token})
    assert [e.findtext(f"{NS}Prefix") for e in rest.iter(f"{NS}CommonPrefixes")] == ["p/records/"]
    assert [e.text for e in rest.iter(f"{NS}Key")] == ["p/meta.json"]


def test_a_listing_waits_for_writes_under_its_prefix_that_arrived_before_it(store: Store):
    """tansu numbers batches before it stores them: a later batch listed while an earlier one is still being written
    would be served to a fetch for the earlier offset, and the consumer would skip it for good."""
    store.client.put("p/records/00000000000000000001.batch", content=b"one")
    body_may_end = threading.Event()

    def slow_body():
        yield b"two-"
        body_may_end.wait(10)
        yield b"end"

    writer = threading.Thread(target=lambda: store.client.put("p/records/00000000000000000002.batch",
                                                              content=slow_body()))
    writer.start()
    time.sleep(0.3)  # the PUT has arrived; its body has not
    keys: list[str] = []
    reader = threading.Thread(target=lambda: keys.extend(
        element.text or "" for element in listing(store, prefix="p/records/").iter(f"{NS}Key")))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), f"the listing answered while an earlier write under its prefix was in flight: {keys}"
    assert listing(store, prefix="q/").find(f"{NS}KeyCount").text == "0"  # other prefixes do not wait
    body_may_end.set()
    writer.join(10)
    reader.join(10)
    assert keys == ["p/records/00000000000000000001.batch", "p/records/00000000000000000002.batch"]
    assert store.client.get("p/records/00000000000000000002.batch").content == b"two-end"


def test_delete_objects_in_bulk(store: Store):
    for key in ("a/1", "a/2", "a/3"):
        store.client.put(key, content=b".")
    body = (b'<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Quiet>true</Quiet>'
            b"<Object><Key>a/1</Key></Object><Object><Key>a/2</Key></Object><Object><Key>gone</Key></Object></Delete>")
    answer = store.client.post("", params={"delete": ""}, content=body)
    assert answer.status_code == 200
    assert ElementTree.fromstring(answer.content).tag == f"{NS}DeleteResult"
    assert [e.text for e in listing(store).iter(f"{NS}Key")] == ["a/3"]


def test_objects_and_etags_survive_a_restart_and_half_writes_vanish(tmp_path: Path):
    first = Store(tmp_path / "data")
    etag = first.client.put("w.json", content=b"1").headers["ETag"]
    first.client.put("r/0.batch", content=b"r0")
    first.stop()
    (tmp_path / "data/.tmp/cut-short").write_bytes(b"half a write")
    second = Store(tmp_path / "data")
    try:
        assert [e.text for e in listing(second).iter(f"{NS}Key")] == ["r/0.batch", "w.json"]
        assert second.client.put("w.json", content=b"x", headers={"If-Match": etag_of(b"0")}).status_code == 412
        assert second.client.put("w.json", content=b"2", headers={"If-Match": etag}).status_code == 200
        assert second.client.put("r/0.batch", content=b"!", headers={"If-None-Match": "*"}).status_code == 412
        assert not (tmp_path / "data/.tmp/cut-short").exists()
    finally:
        second.stop()


def test_refuses_what_it_does_not_implement(store: Store):
    assert store.client.get("", params={"uploads": ""}).status_code == 501  # listing uploads
    assert store.client.put("part", params={"partNumber": "1", "uploadId": "none"}).status_code == 404
    assert store.client.put("copy", headers={"x-amz-copy-source": "/b/k"}).status_code == 501
    for bad in ("a/../b", "a//b", "trailing/"):
        with pytest.raises(S3Error):
            store.server.buckets["b"].path(bad)
    store.client.put("file", content=b".")
    clash = store.client.put("file/child", content=b".")
    assert clash.status_code == 409 and store.client.get("file").content == b"."


def test_multipart_upload_appears_whole_on_completion_and_abort_leaves_nothing(store: Store):
    created = store.client.post("big", params={"uploads": ""})
    upload_id = ElementTree.fromstring(created.content).findtext(f"{NS}UploadId")
    assert created.status_code == 200 and upload_id
    tags = [store.client.put("big", params={"partNumber": str(n), "uploadId": upload_id}, content=body)
            .headers["ETag"] for n, body in ((1, b"first-"), (2, b"second"))]
    assert store.client.get("big").status_code == 404  # nothing shows before completion
    parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{tag}</ETag></Part>" for n, tag in enumerate(tags, 1))
    done = store.client.post("big", params={"uploadId": upload_id},
                             content=f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>")
    assert done.status_code == 200, done.text
    assert store.client.get("big").content == b"first-second"
    digests = hashlib.md5(b"".join(hashlib.md5(b).digest() for b in (b"first-", b"second"))).hexdigest()
    assert ElementTree.fromstring(done.content).findtext(f"{NS}ETag") == f'"{digests}-2"'
    answer = store.client.post("gone", params={"uploads": ""})
    aborted = ElementTree.fromstring(answer.content).findtext(f"{NS}UploadId")
    store.client.put("gone", params={"partNumber": "1", "uploadId": aborted}, content=b"x")
    assert store.client.delete("gone", params={"uploadId": aborted}).status_code == 204
    assert store.client.get("gone").status_code == 404
    assert not any((store.server.root / ".uploads").iterdir())


def test_with_credentials_it_refuses_unsigned_requests(tmp_path: Path):
    server = ObjectStoreServer(tmp_path / "data", ["b"], credentials={"id": "secret"})
    thread = ServerThread(server.app)
    try:
        refused = httpx.get(thread.url + "/b/key")
        assert (refused.status_code, error_code(refused)) == (403, "AccessDenied")
    finally:
        thread.stop()
        server.close()


def test_a_part_streams_to_disk_instead_of_into_memory(store: Store):
    """A 48 MiB part, sent in 1 MiB chunks, takes a few MiB of the server's memory, not the part's size."""
    chunk = bytes(range(256)) * 4096  # 1 MiB
    created = store.client.post("streamed", params={"uploads": ""})
    upload_id = ElementTree.fromstring(created.content).findtext(f"{NS}UploadId")
    tracemalloc.start()
    try:
        sent = store.client.put("streamed", params={"partNumber": "1", "uploadId": upload_id},
                                content=(chunk for _ in range(48)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent.status_code == 200, sent.text
    assert sent.headers["ETag"] == etag_of(chunk * 48)
    assert peak < 16 << 20, f"the upload took {peak / 2**20:.1f} MiB of memory"
    parts = f"<Part><PartNumber>1</PartNumber><ETag>{sent.headers['ETag']}</ETag></Part>"
    done = store.client.post("streamed", params={"uploadId": upload_id},
                             content=f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>")
    assert done.status_code == 200, done.text
    assert hashlib.md5(store.client.get("streamed").content).hexdigest() == hashlib.md5(chunk * 48).hexdigest()
