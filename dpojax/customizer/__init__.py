"""NeMo Customizer, both sides: `client` submits preference pairs to a Customizer deployment;
`server` is a local API-compatible server (`python -m dpojax.customizer.server`) that simulates
jobs or trains them with dpojax. The server depends on the client (errors, file names), never the
other way round.
"""
