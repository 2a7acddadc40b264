"""SGLang side: rollout client, batch schema and validation, and the embedded SGLang-protocol server."""

from megatron_gspo.rollout.client import SGLangClient as SGLangClient
from megatron_gspo.rollout.errors import BatchLayoutError as BatchLayoutError
from megatron_gspo.rollout.errors import EmptyBatchError as EmptyBatchError
from megatron_gspo.rollout.errors import EmptyResponseError as EmptyResponseError
from megatron_gspo.rollout.errors import FinishReasonError as FinishReasonError
from megatron_gspo.rollout.errors import GroupError as GroupError
from megatron_gspo.rollout.errors import InvalidLogprobError as InvalidLogprobError
from megatron_gspo.rollout.errors import LengthMismatchError as LengthMismatchError
from megatron_gspo.rollout.errors import MalformedResponseError as MalformedResponseError
from megatron_gspo.rollout.errors import RolloutBatchTimeoutError as RolloutBatchTimeoutError
from megatron_gspo.rollout.errors import RolloutRequestError as RolloutRequestError
from megatron_gspo.rollout.errors import RolloutServerError as RolloutServerError
from megatron_gspo.rollout.errors import RolloutValidationError as RolloutValidationError
from megatron_gspo.rollout.errors import RoutedExpertsError as RoutedExpertsError
from megatron_gspo.rollout.errors import StaleRolloutError as StaleRolloutError
from megatron_gspo.rollout.errors import TokenIdError as TokenIdError
from megatron_gspo.rollout.errors import WeightUpdateError as WeightUpdateError
from megatron_gspo.rollout.errors import WeightVersionError as WeightVersionError
from megatron_gspo.rollout.requests import build_generate_request as build_generate_request
from megatron_gspo.rollout.server.launch import EmbeddedServer as EmbeddedServer
from megatron_gspo.rollout.server.launch import launch_embedded_server as launch_embedded_server
from megatron_gspo.rollout.types import RolloutBatch as RolloutBatch
from megatron_gspo.rollout.types import RolloutSample as RolloutSample
from megatron_gspo.rollout.validation import parse_generate_response as parse_generate_response
