"""The NeMo Customizer client: `client` submits preference pairs to a Customizer deployment.
The local API-compatible server that simulates jobs or trains them with dpojax is a wing of its
own, `dpojax.customizer_server` (`python -m dpojax.customizer_server`); it depends on the
client, never the other way round.
"""
