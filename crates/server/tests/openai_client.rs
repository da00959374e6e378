//! The official `openai` Python client (PyPI `openai`) against a real worker: chat streaming and not,
//! completions, stop sequences, seeded sampling, typed errors; then tool calling and structured
//! output; the Responses API; Anthropic's client on the Messages API. `.ci/run` installs the package.

mod common;

#[test]
fn the_official_openai_client_works() {
    let w = common::Worker::start(&[]);
    common::run_python("openai_client.py", &format!("http://{}", w.addr), &[]);
}

#[test]
fn tools_and_structured_output_through_the_official_client() {
    let w = common::Worker::start(&[]);
    common::run_python("openai_tools.py", &format!("http://{}", w.addr), &["100"]);
}

/// DeepSeek's DSML format (`--tool-parser deepseek_v4`): forced calls written in DSML, their
/// arguments streamed in pieces through chat, Responses and Messages.
#[test]
fn dsml_calls_stream_their_arguments_through_the_official_clients() {
    let w = common::Worker::start(&["--tool-parser", "deepseek_v4"]);
    common::run_python("dsml_tools.py", &format!("http://{}", w.addr), &[]);
}

#[test]
fn the_responses_api_through_the_official_client() {
    let w = common::Worker::start(&[]);
    common::run_python("openai_responses.py", &format!("http://{}", w.addr), &[]);
}

#[test]
fn anthropic_messages_through_the_official_client() {
    let w = common::Worker::start(&[]);
    common::run_python("anthropic_messages.py", &format!("http://{}", w.addr), &[]);
}
