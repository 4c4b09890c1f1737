"""The local Customizer server's dpojax backend really trains: submit -> train -> HF model."""

from __future__ import annotations

import numpy as np

from dpojax.customizer.client import EXIT_OK, submit
from dpojax.customizer.server.backends import DpojaxBackend
from dpojax.models import from_pretrained
from dpojax.models.tiny import make_tiny_checkpoint
from tests.customizer.conftest import make_pairs, settings_for


def test_dpojax_backend_trains_a_tiny_model_through_the_api(start_server, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    backend = DpojaxBackend({"tiny": model_dir})  # the real dpojax training function
    server = start_server(backend)
    settings = settings_for(
        server,
        customization_config="tiny@v1",
        training_timeout_seconds=300.0,
        hyperparameters={
            "training_type": "dpo",
            "finetuning_type": "all_weights",
            "epochs": 2,
            "batch_size": 2,
            "learning_rate": 1e-3,
            "dpo": {"ref_policy_kl_penalty": 0.1},
        },
    )
    result = submit(make_pairs(10), settings, workdir=tmp_path / "run", environ={})
    assert result.exit_code == EXIT_OK, result.status
    status = result.status
    assert status.status == "completed" and status.epochs_completed == 2
    assert status.train_loss is not None and status.val_loss is not None
    assert status.train_loss < 0.6931  # it learned something from ln 2 at step 0
    output = server.store.jobs[result.job_id].output_dir
    assert output.is_relative_to(server.store.root)
    model, tokenizer = from_pretrained(output)
    assert model.config.num_layers == 2 and tokenizer is not None
    original, _ = from_pretrained(model_dir, tokenizer=False)
    assert not np.array_equal(
        np.asarray(model.layers[0].mlp.up_proj.kernel[...]),
        np.asarray(original.layers[0].mlp.up_proj.kernel[...]),
    )
