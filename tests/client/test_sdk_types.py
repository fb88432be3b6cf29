"""The SDK's answer types name every field the server documents for that answer (its OpenAPI schema), so a typed
backend can read ``turn["usage"]`` or ``deployment["manifest"]`` without a checker calling them unknown keys."""

from __future__ import annotations

import typing

import pytest

from moorage.api import schemas as S
from moorage.api.routes.executions import EXECUTION
from moorage.api.routes.users import USER_SCHEMA
from moorage.api.routes.webhooks import DELIVERY, WEBHOOK
from moorage.client import types as T

PAIRS = [(T.Turn, S.COMPONENTS["TurnResult"]), (T.Execution, EXECUTION), (T.Deployment, S.COMPONENTS["Deployment"]),
         (T.Agent, S.COMPONENTS["Agent"]), (T.ApiKey, S.COMPONENTS["ApiKey"]), (T.UserToken, S.COMPONENTS["UserToken"]),
         (T.Usage, S.COMPONENTS["Usage"]), (T.Forgotten, S.COMPONENTS["Forgotten"]), (T.User, USER_SCHEMA),
         (T.Webhook, WEBHOOK), (T.Delivery, DELIVERY)]


@pytest.mark.parametrize("typed, schema", PAIRS, ids=[t.__name__ for t, _ in PAIRS])
def test_every_documented_field_is_typed(typed, schema) -> None:
    assert set(schema["properties"]) - set(typing.get_type_hints(typed)) == set()
