"""SGLang side: rollout client, batch schema and validation, and the embedded SGLang-protocol server."""

from megatron_gspo.rollout.server_launch import EmbeddedServer as EmbeddedServer
from megatron_gspo.rollout.server_launch import launch_embedded_server as launch_embedded_server
