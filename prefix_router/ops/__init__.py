"""Operations: the ``prefix-router`` command, ``prefix-router up``, starting and stopping the
components as child processes, and printing an Envoy bootstrap for deployments."""
