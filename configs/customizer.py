"""Submit preference pairs to a NeMo Customizer service (or the local compatible server).

    python -m dpojax.main --config configs/customizer.py --workdir runs/customizer \
        --config.data.train_path=pairs.jsonl \
        --config.customizer.entity_host=https://nmp.example.com \
        --config.customizer.datastore_host=https://datastore.example.com \
        --config.customizer.namespace=my-team \
        --config.customizer.customization_config=meta/llama-3.2-1b-instruct@v1.0.0+A100

The Datastore token comes from the HF_TOKEN environment variable (or customizer.hf_token); it is
never printed or written. Try it locally against
`python -m dpojax.customizer_server --backend simulate --root /tmp/nmp --port 8000`.
"""

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.mode = "submit"
    config.collect.workflow = "tictactoe"  # pairs collected first when data.train_path is empty
    config.customizer.entity_host = "http://127.0.0.1:8000"
    config.customizer.datastore_host = "http://127.0.0.1:8000"
    config.customizer.namespace = "dpojax"
    config.customizer.customization_config = "meta/llama-3.2-1b-instruct@v1.0.0+A100"
    config.customizer.hyperparameters.finetuning_type = "lora"
    config.customizer.hyperparameters.epochs = 2
    return config
