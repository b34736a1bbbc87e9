"""ext_proc's gRPC server: our gRPC call layer and asyncio transport on libnghttp2
(``engine.py``, the one module that imports the ``ngh2`` binding), with limits on
every peer (``limits.py``). See docs/data-path.md."""
