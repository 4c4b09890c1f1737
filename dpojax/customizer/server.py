"""`python -m dpojax.customizer.server`: the documented alias of `python -m
dpojax.customizer_server`, the local Customizer-compatible server (its home since the server
became a wing of its own; this alias stays for one release)."""

from dpojax.customizer_server import (  # noqa: F401 - the names the old package exported
    BACKENDS,
    ServerHandle,
    build_app,
    main,
    make_backend,
    serve_in_thread,
)

if __name__ == "__main__":
    raise SystemExit(main())
