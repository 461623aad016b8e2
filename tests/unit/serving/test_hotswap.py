"""Hot swap with an s3:// checkpoint: the dev model server is given a folder on its own disk, downloaded and checked."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from agentstream.deploy.deployments import Action, Routing, decide
from agentstream.infra.checkpoint_store import S3Store, open_store
from agentstream.infra.config import CHECKPOINT_BUCKET, CheckpointsConfig, Config, Secret, TrainerConfig
from agentstream.infra.files import sha256_file
from agentstream.models import load_model
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.hotswap import HotSwapError, HotSwapper
from agentstream.stack.objectstore import ObjectStoreServer
from agentstream.trainer.checkpoint_writer import write_checkpoint
from agentstream.trainer.policy import build_policy, save_weights
from tests.support.http_thread import ServerThread


def test_an_s3_checkpoint_reaches_the_server_as_a_checked_local_folder(tmp_path: Path):
    objects = ObjectStoreServer(tmp_path / "objects", [CHECKPOINT_BUCKET], credentials={"id": "secret"})
    store_thread = ServerThread(objects.app)
    name = "tiny-s3"
    server = create_app(load_model("tiny", threads=None), served_model_names=(name,))
    server_thread = ServerThread(server)
    try:
        settings = CheckpointsConfig(s3_endpoint=store_thread.url, s3_access_key_id="id",
                                     s3_secret_access_key=Secret("secret"), cache_dir=str(tmp_path / "swap-cache"))
        config = Config(checkpoints=settings, trainer=TrainerConfig(model="tiny", model_name=name, device="cpu"))
        store = open_store(f"s3://{CHECKPOINT_BUCKET}/runs/1", replace(settings, cache_dir=str(tmp_path / "trainer")),
                           tmp_path)
        assert isinstance(store, S3Store)
        staging = store.staging()
        weights = save_weights(build_policy(config.trainer), staging)
        manifest = write_checkpoint(store, staging, weights, model=name, version=1, step=1, format="full",
                                    offsets={}, trained_ids=[], metrics={})
        assert manifest.uri.startswith(f"s3://{CHECKPOINT_BUCKET}/runs/1/")
        swapper = HotSwapper(config, "127.0.0.1:1", server_thread.url, name)

        async def swap() -> Path:
            try:
                with pytest.raises(HotSwapError, match="does not exist"):
                    await swapper.apply(replace(manifest.checkpoint(), uri=manifest.uri.replace("v00000001", "v9")))
                await swapper.apply(manifest.checkpoint())
                return Path(swapper.folders[1])
            finally:
                await swapper.close()

        folder = asyncio.run(swap())
        assert server[SERVER].version == 1
        assert folder.parent == tmp_path / "swap-cache"
        assert sha256_file(folder / "model.safetensors") == manifest.sha256
    finally:
        server_thread.stop()
        store_thread.stop()
        objects.close()


def test_a_server_that_loaded_an_older_version_than_its_fleet_promoted_does_not_promote_it(tmp_path: Path):
    """Hot swap over a fleet: one server's loop saw v8 last while another's had loaded and promoted v9 (its
    checkpoint follower was ahead); v8 must not be promoted after v9, or the deployment goes back a version."""
    name = "tiny-fleet"
    server = create_app(load_model("tiny", threads=None), served_model_names=(name,))
    server_thread = ServerThread(server)
    try:
        config = Config(trainer=TrainerConfig(model="tiny", model_name=name, device="cpu"))
        store = open_store(str(tmp_path / "checkpoints"))
        staging = store.staging()
        older = write_checkpoint(store, staging, save_weights(build_policy(config.trainer), staging), model=name,
                                 version=8, step=8, format="full", offsets={}, trained_ids=[], metrics={})
        newer = decide(Routing(name), 9, Action.PROMOTED, "hotswap", "held first by another server",
                       stable_version=9, format="full")
        promotions = {9: newer}  # what the other server's loop decided, in the same process
        swapper = HotSwapper(config, "127.0.0.1:1", server_thread.url, name, promotions=promotions)
        swapper.checkpoints[8] = older.checkpoint()

        async def promote() -> None:
            try:
                await swapper._promote_newest(asyncio.Event())
            finally:
                await swapper.close()

        asyncio.run(promote())
        assert server[SERVER].version == 8  # loaded: reconciling brings it to v9 next
        assert swapper.routing.stable_version == 9 and list(promotions) == [9]
    finally:
        server_thread.stop()
