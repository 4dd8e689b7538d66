# syntax=docker/dockerfile:1
# cachehit-router image: the router (and the simulator, for [[engines]] of kind "sim").
# Real vLLM engines run in vLLM's own image with this project's plugin: see docs/DOCKER.md.
#
#   docker build -t cachehit-router .
#   docker run -v ./router.toml:/etc/cachehit-router/router.toml:ro -p 8000:8000 cachehit-router

# --- build: a wheel of the project, so the runtime image holds no sources or build tools ---
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY engine_launcher ./engine_launcher
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- runtime -------------------------------------------------------------------------------
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROUTER_HEALTH_URL=http://127.0.0.1:8000/health

# An unprivileged user with a fixed uid (so mounted files can be granted to it).
RUN groupadd --system --gid 10001 router \
 && useradd --system --uid 10001 --gid router --home-dir /var/lib/cachehit-router \
      --shell /usr/sbin/nologin router \
 && install -d -o router -g router -m 0750 /var/lib/cachehit-router \
 && install -d -m 0755 /etc/cachehit-router

# The project without engine extras (no vLLM, no NIXL): aiohttp, uvloop, orjson, ...
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels

# A default configuration (a simulated cluster); mount your own over it.
COPY router.toml /etc/cachehit-router/router.toml

# Working directory: engine logs of [[engines]] (launcher.log_dir, relative) land here.
WORKDIR /var/lib/cachehit-router
USER 10001:10001
EXPOSE 8000

# No curl in slim images; Python's urllib is enough. Set ROUTER_HEALTH_URL when the router
# listens on another port.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request; r = urllib.request.urlopen(os.environ['ROUTER_HEALTH_URL'], timeout=4); sys.exit(0 if r.status == 200 else 1)"]

ENTRYPOINT ["router"]
# --host 0.0.0.0: published ports reach the container's interface, never its loopback, so the
# usual server.host = "127.0.0.1" of a router.toml would make the container unreachable.
CMD ["--config", "/etc/cachehit-router/router.toml", "--host", "0.0.0.0"]
