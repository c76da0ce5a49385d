"""Run one resources server that nemo-gym 0.4.0 ships, on 127.0.0.1, from nemo-gym's own venv:

    <nemo-gym venv>/bin/python nemo_gym_serve.py example_single_tool_call PORT

It loads the server's own `app.py` and serves the FastAPI app its class builds
(`setup_webserver`) with uvicorn. NeMo Gym's usual launcher (`ng_run`) also starts Ray, a head
server and Hydra configs; a resources server needs none of them to answer `/seed_session`, its
tools and `/verify`, so the server object is constructed without a head-server client
(`model_construct`: nemo-gym 0.4.0 validates `server_client` as required).
"""

import importlib.util
import os
import sys

import uvicorn

name, port = sys.argv[1], int(sys.argv[2])
import resources_servers  # noqa: E402
from nemo_gym.base_resources_server import SimpleResourcesServer  # noqa: E402

path = os.path.join(next(iter(resources_servers.__path__)), name, "app.py")
spec = importlib.util.spec_from_file_location(f"ng_{name}", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
cls = next(
    v
    for v in vars(mod).values()
    if isinstance(v, type) and issubclass(v, SimpleResourcesServer) and v is not SimpleResourcesServer
)
cfg = cls.model_fields["config"].annotation(host="127.0.0.1", port=port, entrypoint="app.py", name=name)
app = cls.model_construct(config=cfg, server_client=None).setup_webserver()
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
