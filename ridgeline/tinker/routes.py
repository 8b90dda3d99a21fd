"""The routes of the Tinker API (the paths the `tinker` SDK 0.38 calls), on `ridgeline serve`'s
HTTP gate (`ridgeline.inference.http_app`: key, body cap, one error shape)."""

from __future__ import annotations

from ridgeline.inference.http_app import Route
from ridgeline.tinker.service import TinkerService

API = "/api/v1"


def tinker_routes(service: TinkerService) -> list[Route]:
    s = service
    get = [("/healthz", s.health), ("/get_server_capabilities", s.capabilities),
           ("/training_runs/{model_id}/checkpoints", s.list_checkpoints), ("/samplers/{sampler_id}", s.get_sampler)]
    post = [("/client/config", s.client_config), ("/client/dynamic_config", s.dynamic_config),
            ("/create_session", s.create_session), ("/session_heartbeat", s.heartbeat), ("/telemetry", s.telemetry),
            ("/create_model", s.create_model), ("/get_info", s.get_info), ("/optim_step", s.optim_step),
            ("/save_weights", s.save_weights), ("/save_weights_for_sampler", s.save_weights_for_sampler),
            ("/load_weights", s.load_weights), ("/create_sampling_session", s.create_sampling_session),
            ("/asample", s.sample), ("/retrieve_future", s.retrieve_future),
            ("/sessions/{session_id}/finish", s.finish_session)]
    routes = [Route("GET", API + path, handler, "native") for path, handler in get]
    routes += [Route("POST", API + path, handler, "native") for path, handler in post]
    routes.append(Route("POST", API + "/forward_backward", s.forward_backward, "native", body="bytes"))
    return routes
