"""A2A shapes of a sandlot session (``sandlot.sdk.a2a``): a real grant from ``sandlot serve``
carried through a2a-sdk's own types and JSON, read back by another agent that attaches
with its own key; the token left out unless asked for; malformed ``sandlot://`` URIs
refused."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from a2a.compat.v0_3 import types as v03
from a2a.types import Message, Part, Role, Task, TaskState, TaskStatus
from google.protobuf.json_format import MessageToDict, ParseDict

from sandlot.protocol.uris import parse_sandbox_uri, sandbox_uri
from sandlot.sdk import AsyncSandbox, AsyncSandlot, Grant, a2a
from sandlot.sdk.types import Scope
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(60)

REPORT = "/workspace/out/report.md"
NOTES = "/workspace/notes 100%?.txt"
#: How every sandbox token (a JWT: base64url of '{"') starts.
JWT = "eyJ"


@pytest.fixture
async def sender(server: SandlotServer, human_key: str) -> AsyncIterator[AsyncSandbox]:
    """A sandbox a human's session holds, with two files in it."""
    async with AsyncSandlot(server.url, human_key) as client:
        sandbox = await client.ensure(f"thr_{uuid.uuid4().hex[:10]}")
        await sandbox.write(REPORT, "# findings\n")
        await sandbox.write(NOTES, "odd name\n")
        yield sandbox


def wire(item: Any) -> str:
    """An a2a-sdk object as its JSON-RPC server puts it on the wire."""
    return json.dumps(MessageToDict(item))


async def test_a_session_travels_through_a2a_sdk_to_another_agent(
    server: SandlotServer, sender: AsyncSandbox, agent_key: str, human_key: str
) -> None:
    grant = sender.grant
    request = Message(
        message_id="msg-1",
        context_id=a2a.context_id(grant.sandbox_id),
        role=Role.ROLE_USER,
        parts=[Part(text="review the report"), a2a.new_file_part(grant.sandbox_id, NOTES)],
        metadata=a2a.environment_metadata(grant, broker_url=server.url),
    )
    task = Task(
        id="task-1",
        context_id=a2a.context_id(grant.sandbox_id),
        status=TaskStatus(state=TaskState.TASK_STATE_COMPLETED),
        artifacts=[a2a.new_file_artifact(grant.sandbox_id, [REPORT], name="report")],
        history=[request],
        metadata=a2a.environment_metadata(grant),
    )
    sent = wire(task)
    assert JWT not in sent
    assert human_key not in sent
    # The receiver validates with a2a-sdk, as its JSON-RPC dispatcher does.
    received = ParseDict(json.loads(sent), Task())
    assert received == task

    env = a2a.environment_of(received)
    assert env is not None
    assert env.sandbox_id == grant.sandbox_id
    assert env.scope is not None and grant.scope == {"type": env.scope.type, "id": env.scope.id}
    assert env.session_id == grant.session_id
    assert env.capabilities == grant.capabilities
    assert (env.http_base_url, env.ws_base_url) == (grant.http_base_url, grant.ws_base_url)
    assert env.token is None
    files = a2a.files_of(received)
    assert [(f.sandbox_id, f.path) for f in files] == [
        (grant.sandbox_id, REPORT),
        (grant.sandbox_id, NOTES),
    ]
    asked = a2a.environment_of(received.history[0])
    assert asked is not None and asked.broker_url == server.url

    # Another agent of the same user attaches with its own key and reads the files.
    async with AsyncSandlot(asked.broker_url, agent_key) as client:
        theirs = await client.attach_sandbox(env.sandbox_id)
        # The scope's one binding, with a token of the receiver's own.
        assert theirs.grant.session_id == env.session_id
        assert JWT in theirs.grant.token and theirs.grant.token not in sent
        assert [(await theirs.read(f.path)).content for f in files] == [
            "# findings\n",
            "odd name\n",
        ]


async def test_the_dicts_are_a2a_sdk_json(sender: AsyncSandbox) -> None:
    """The plain dicts pass a2a-sdk's strict parse and are what it would serialize."""
    grant = sender.grant
    body = a2a.message(grant, text="look", files=[REPORT, NOTES], task_id="task-1")
    parsed = ParseDict(body, Message())
    assert MessageToDict(parsed) == body
    assert parsed.context_id == f"sandlot://{grant.sandbox_id}"
    assert [p.filename for p in parsed.parts[1:]] == ["report.md", "notes 100%?.txt"]
    artifact = a2a.file_artifact(grant.sandbox_id, [REPORT], name="r", artifact_id="a1")
    typed = a2a.new_file_artifact(grant.sandbox_id, [REPORT], name="r", artifact_id="a1")
    assert MessageToDict(typed) == artifact
    part = a2a.file_part(grant.sandbox_id, REPORT, media_type="text/markdown")
    assert MessageToDict(ParseDict(part, Part())) == part
    assert a2a.files_of(part) == [a2a.SandboxFile(grant.sandbox_id, REPORT, "text/markdown")]
    typed_message = a2a.new_message(grant, text="x", message_id="m", role="agent")
    assert typed_message.role == Role.ROLE_AGENT
    assert MessageToDict(typed_message) == a2a.message(
        grant, text="x", message_id="m", role="agent"
    )
    with pytest.raises(ValueError, match="needs a part"):
        a2a.message(grant)


async def test_the_token_travels_only_when_asked(sender: AsyncSandbox) -> None:
    grant = sender.grant
    # The SDK refreshes the token in the background: look for any token, not this one.
    plain = json.dumps(a2a.message(grant, text="x", files=[REPORT]))
    assert '"token"' not in plain and JWT not in plain
    env = a2a.environment_of(json.loads(plain))
    assert env is not None and env.token is None
    with pytest.raises(ValueError, match="attach_sandbox"):
        env.grant()

    carried = wire(a2a.new_message(grant, text="x", include_token=True))
    assert JWT in carried
    env = a2a.environment_of(ParseDict(json.loads(carried), Message()))
    assert env is not None and env.token is not None and env.token in carried
    assert env.expires_at is not None and "token" not in repr(env)
    # A grant in hand: the dataplane takes the sender's token until it expires.
    async with AsyncSandbox(env.grant()) as borrowed:
        assert (await borrowed.read(REPORT)).content == "# findings\n"
        assert abs(borrowed.grant.seconds_left() - grant.seconds_left()) < 2


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("sandlot://sb_1/workspace/../etc/passwd", r"'\.\.'"),
        ("sandlot://sb_1/workspace/%2e%2E/etc/passwd", r"'\.\.'"),
        ("sandlot://sb_1/workspace%2F..%2Fetc", r"'\.\.'"),
        ("sandlot://sb_1/..", r"'\.\.'"),
        ("sandlot://sb_1/a%00b", "NUL"),
        ("sandlot://sb_1/a b", "percent-encoded"),
        ("sandlot://sb_1/a%zz", "percent-encoded"),
        ("sandlot://sb_1/a%ff", "UTF-8"),
        ("sandlot://sb_1/a?raw=1", "query or fragment"),
        ("sandlot://sb_1/a#top", "query or fragment"),
        ("sandlot://user@sb_1/a", "not a session or sandbox id"),
        ("sandlot://sb_1:80/a", "not a session or sandbox id"),
        ("sandlot:///workspace/a", "not a session or sandbox id"),
        ("sandlot:sb_1/workspace/a", "not a sandlot:// URI"),
        ("sandlot://sb_1", "names a sandbox, not a file"),
        ("sandlot://sb_1/", "names a sandbox, not a file"),
    ],
)
def test_malformed_uris_are_refused(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        a2a.parse_file_uri(uri)
    with pytest.raises(ValueError, match=why):
        a2a.files_of({"messageId": "m", "parts": [{"url": uri}]})


@pytest.mark.parametrize(
    ("sandbox_id", "path", "why"),
    [
        ("sb_1", "/workspace/../etc/passwd", r"'\.\.'"),
        ("sb_1", "workspace/a.py", "not an absolute sandbox path"),
        ("sb_1", "/a\x00b", "NUL"),
        ("sb 1", "/workspace/a.py", "not a session or sandbox id"),
        ("sb_1/x", "/workspace/a.py", "not a session or sandbox id"),
    ],
)
def test_parts_of_bad_paths_are_refused(sandbox_id: str, path: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        a2a.file_part(sandbox_id, path)


@pytest.mark.parametrize(
    "path",
    ["/workspace/a b.py", "/w/100%.txt", "/w/q?#.md", "/w/é/ü.txt", "/w/..hidden", "/w/./x", "/"],
)
def test_uris_round_trip(path: str) -> None:
    uri = sandbox_uri("sb_1", path)
    assert parse_sandbox_uri(uri) == ("sb_1", path)
    assert "?" not in uri and "#" not in uri and " " not in uri


def test_what_is_not_sandlots_is_left_alone() -> None:
    other = {
        "messageId": "m",
        "contextId": "ctx-42",
        "parts": [{"text": "hi"}, {"url": "https://example.com/a.txt"}, {"raw": "AA=="}],
    }
    assert a2a.environment_of(other) is None
    assert a2a.files_of(other) == []
    by_context = a2a.environment_of({**other, "contextId": "sandlot://sb_9"})
    assert by_context == a2a.Environment(sandbox_id="sb_9")


def test_the_context_and_the_metadata_must_agree() -> None:
    grant = Grant(sandbox_id="sb_a", http_base_url="http://h", ws_base_url="ws://h", token="t")
    body = a2a.message(grant, text="x")
    assert a2a.environment_of(body) is not None
    with pytest.raises(ValueError, match="sb_b"):
        a2a.environment_of({**body, "contextId": "sandlot://sb_b"})
    with pytest.raises(ValueError, match="a context is a sandbox"):
        a2a.environment_of({**body, "contextId": "sandlot://sb_a/workspace"})
    env = body["metadata"][a2a.METADATA_KEY]
    for broken in ({**env, "sandbox_id": "../sb_a"}, {**env, "scope": {"type": "thread"}}, "x"):
        with pytest.raises(ValueError):
            a2a.environment_of({**body, "metadata": {a2a.METADATA_KEY: broken}})


def test_a2a_0_3_objects_are_read() -> None:
    """An agent on A2A 0.3 (a2a-sdk's compat models) names files as ``file.uri``."""
    message = v03.Message(
        message_id="m",
        role=v03.Role.user,
        context_id="sandlot://sb_1",
        parts=[
            v03.Part(root=v03.TextPart(text="see")),
            v03.Part(
                root=v03.FilePart(
                    file=v03.FileWithUri(uri="sandlot://sb_1/workspace/a.py", mime_type="text/x-py")
                )
            ),
            v03.Part(root=v03.FilePart(file=v03.FileWithUri(uri="https://example.com/b"))),
        ],
        metadata={a2a.METADATA_KEY: {"sandbox_id": "sb_1", "scope": {"type": "run", "id": "r"}}},
    )
    env = a2a.environment_of(message)
    assert env is not None and (env.sandbox_id, env.scope) == ("sb_1", Scope(type="run", id="r"))
    assert a2a.files_of(message) == [a2a.SandboxFile("sb_1", "/workspace/a.py", "text/x-py")]


def test_the_dict_shapes_load_no_a2a_sdk() -> None:
    """The SDK's own dependency set is enough for the dicts: a2a-sdk stays unimported."""
    code = (
        "import sys\n"
        "from sandlot.sdk import Grant, a2a\n"
        "g = Grant(sandbox_id='sb_1', http_base_url='http://h', ws_base_url='ws://h', token='t')\n"
        "a2a.files_of(a2a.message(g, text='x', files=['/a']))\n"
        "print(','.join(m for m in ('a2a', 'google.protobuf', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
