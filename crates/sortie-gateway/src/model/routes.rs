//! Which vendor routes the model proxy forwards (sans-IO: a method and a path in, a [`Route`] or a
//! refusal out). Only the inference, streaming, token-count and model-list routes the agents use are
//! allowed; everything else a vendor serves with the same key (files, batches, fine-tuning, vector
//! stores, cached contents, organization and admin endpoints) is refused before a key is looked up,
//! so the workspace's key is never lent to it.
//!
//! The path is the agent's, after `/_sortie/model/<api>/` and without the query. It is matched as
//! it is, segment by segment, against literal names: no decoding, no `.`/`..` resolution, no empty
//! segment, and variable segments (model ids) limited to `[A-Za-z0-9._-]` (plus `:` for OpenAI's
//! fine-tuned ids), so no encoding (`%2e`, `%2f`) or normalisation by the vendor can turn an
//! allowed path into another route. This must never allow a route that can read, write or delete
//! anything stored at the vendor, or change an account.

use axum::http::Method;

use super::ModelApi;

/// An allowed route, named for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Anthropic `POST /v1/messages` (Claude Code adds `?beta=true`; opencode does not).
    AnthropicMessages,
    /// Anthropic `POST /v1/messages/count_tokens`.
    AnthropicCountTokens,
    /// OpenAI `POST /v1/responses` (Codex).
    OpenaiResponses,
    /// OpenAI `POST /v1/responses/input_tokens`, the Responses API's token count.
    OpenaiInputTokens,
    /// OpenAI `POST /v1/chat/completions`.
    OpenaiChatCompletions,
    /// Gemini `POST /{v1beta,v1}/models/{model}:generateContent` (Gemini CLI's router call).
    GeminiGenerateContent,
    /// Gemini `POST /{v1beta,v1}/models/{model}:streamGenerateContent` (Gemini CLI's turns).
    GeminiStreamGenerateContent,
    /// Gemini `POST /{v1beta,v1}/models/{model}:countTokens`.
    GeminiCountTokens,
    /// `GET` of the model list of any API (`/v1/models`, `/v1beta/models`).
    ListModels,
    /// `GET` of one model of any API (`/v1/models/{id}`, `/v1beta/models/{model}`).
    GetModel,
}

impl Route {
    /// Whether its answer is a generation that costs tokens (and reports them).
    pub fn generates(self) -> bool {
        matches!(
            self,
            Self::AnthropicMessages
                | Self::OpenaiResponses
                | Self::OpenaiChatCompletions
                | Self::GeminiGenerateContent
                | Self::GeminiStreamGenerateContent
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::AnthropicMessages => "messages",
            Self::AnthropicCountTokens => "count_tokens",
            Self::OpenaiResponses => "responses",
            Self::OpenaiInputTokens => "input_tokens",
            Self::OpenaiChatCompletions => "chat_completions",
            Self::GeminiGenerateContent => "generate_content",
            Self::GeminiStreamGenerateContent => "stream_generate_content",
            Self::GeminiCountTokens => "count_tokens",
            Self::ListModels => "list_models",
            Self::GetModel => "get_model",
        }
    }
}

/// The most of the agent's path a refusal repeats.
const SHOWN_PATH_CHARS: usize = 120;

/// The route `method rest` names on `api`, or the one line that refuses it (naming the route).
pub fn allowed(api: ModelApi, method: &Method, rest: &str) -> Result<Route, String> {
    route(api, method, rest).ok_or_else(|| {
        let mut shown: String = rest.chars().take(SHOWN_PATH_CHARS).collect();
        if shown.len() < rest.len() {
            shown.push('…');
        }
        format!(
            "sortie: the model proxy does not forward {method} /{shown} to {api}: only the inference, \
             token-count and model-list routes agents use are allowed"
        )
    })
}

fn route(api: ModelApi, method: &Method, rest: &str) -> Option<Route> {
    let segments: Vec<&str> = rest.split('/').collect();
    if segments.iter().any(|segment| segment.is_empty()) {
        return None;
    }
    let post = method == Method::POST;
    let get = method == Method::GET;
    match (api, segments.as_slice()) {
        (ModelApi::Anthropic, ["v1", "messages"]) if post => Some(Route::AnthropicMessages),
        (ModelApi::Anthropic, ["v1", "messages", "count_tokens"]) if post => Some(Route::AnthropicCountTokens),
        (ModelApi::Openai, ["v1", "responses"]) if post => Some(Route::OpenaiResponses),
        (ModelApi::Openai, ["v1", "responses", "input_tokens"]) if post => Some(Route::OpenaiInputTokens),
        (ModelApi::Openai, ["v1", "chat", "completions"]) if post => Some(Route::OpenaiChatCompletions),
        (ModelApi::Anthropic | ModelApi::Openai, ["v1", "models"]) if get => Some(Route::ListModels),
        (ModelApi::Anthropic, ["v1", "models", id]) if get && is_model_id(id, false) => Some(Route::GetModel),
        (ModelApi::Openai, ["v1", "models", id]) if get && is_model_id(id, true) => Some(Route::GetModel),
        (ModelApi::Gemini, [version, "models"]) if get && is_gemini_version(version) => Some(Route::ListModels),
        (ModelApi::Gemini, [version, "models", call]) if is_gemini_version(version) => gemini_call(method, call),
        _ => None,
    }
}

/// `{model}` (a `GET`) or `{model}:{method}` (a `POST`) under Gemini's `models/`.
fn gemini_call(method: &Method, call: &str) -> Option<Route> {
    match call.split_once(':') {
        None if method == Method::GET && is_model_id(call, false) => Some(Route::GetModel),
        Some((model, action)) if method == Method::POST && is_model_id(model, false) => match action {
            "generateContent" => Some(Route::GeminiGenerateContent),
            "streamGenerateContent" => Some(Route::GeminiStreamGenerateContent),
            "countTokens" => Some(Route::GeminiCountTokens),
            _ => None,
        },
        _ => None,
    }
}

/// `v1beta` (what Gemini CLI calls) or `v1` (the same inference routes, stable).
fn is_gemini_version(segment: &str) -> bool {
    matches!(segment, "v1beta" | "v1")
}

/// A model id as vendors spell them: letters, digits, `.`, `_`, `-` (and `:` in OpenAI's
/// `ft:…` ids), not `.` or `..`.
fn is_model_id(segment: &str, colon: bool) -> bool {
    !segment.is_empty()
        && segment != "."
        && segment != ".."
        && segment
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-') || (colon && byte == b':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_routes_are_allowed_and_nothing_else() {
        use ModelApi::{Anthropic, Gemini, Openai};
        let (get, post, delete, put) = (Method::GET, Method::POST, Method::DELETE, Method::PUT);
        let cases: &[(ModelApi, &Method, &str, Option<Route>)] = &[
            // What the built-in agents and the fake vendors use.
            (Anthropic, &post, "v1/messages", Some(Route::AnthropicMessages)),
            (
                Anthropic,
                &post,
                "v1/messages/count_tokens",
                Some(Route::AnthropicCountTokens),
            ),
            (Openai, &post, "v1/responses", Some(Route::OpenaiResponses)),
            (
                Openai,
                &post,
                "v1/responses/input_tokens",
                Some(Route::OpenaiInputTokens),
            ),
            (Openai, &post, "v1/chat/completions", Some(Route::OpenaiChatCompletions)),
            (
                Gemini,
                &post,
                "v1beta/models/gemini-2.5-pro:streamGenerateContent",
                Some(Route::GeminiStreamGenerateContent),
            ),
            (
                Gemini,
                &post,
                "v1beta/models/gemini-3.5-flash-lite:generateContent",
                Some(Route::GeminiGenerateContent),
            ),
            (
                Gemini,
                &post,
                "v1beta/models/gemini-2.5-pro:countTokens",
                Some(Route::GeminiCountTokens),
            ),
            (
                Gemini,
                &post,
                "v1/models/gemini-2.5-pro:generateContent",
                Some(Route::GeminiGenerateContent),
            ),
            // Model lists and single models.
            (Anthropic, &get, "v1/models", Some(Route::ListModels)),
            (Anthropic, &get, "v1/models/claude-sonnet-4-5", Some(Route::GetModel)),
            (Openai, &get, "v1/models", Some(Route::ListModels)),
            (Openai, &get, "v1/models/gpt-5.5", Some(Route::GetModel)),
            (
                Openai,
                &get,
                "v1/models/ft:gpt-4o:org:custom:abc",
                Some(Route::GetModel),
            ),
            (Gemini, &get, "v1beta/models", Some(Route::ListModels)),
            (Gemini, &get, "v1beta/models/gemini-2.5-pro", Some(Route::GetModel)),
            // Stored data, accounts, other methods: refused.
            (Openai, &get, "v1/files", None),
            (Openai, &delete, "v1/files/file-OTHER-USERS-UPLOAD", None),
            (Openai, &post, "v1/fine_tuning/jobs", None),
            (Openai, &get, "v1/organization/admin_api_keys", None),
            (Openai, &post, "v1/batches", None),
            (Openai, &get, "v1/responses/resp_123", None),
            (Openai, &delete, "v1/responses/resp_123", None),
            (Openai, &post, "v1/vector_stores", None),
            (Openai, &delete, "v1/models/ft:gpt-4o:org:custom:abc", None),
            (Openai, &get, "v1/responses", None),
            (Anthropic, &post, "v1/messages/batches", None),
            (Anthropic, &get, "v1/messages/batches/msgbatch_1/results", None),
            (Anthropic, &post, "v1/files", None),
            (Anthropic, &get, "v1/organizations/workspaces", None),
            (Anthropic, &put, "v1/messages", None),
            (Anthropic, &get, "v1/messages", None),
            (Anthropic, &post, "v1/complete", None),
            (Gemini, &get, "v1beta/files", None),
            (Gemini, &post, "upload/v1beta/files", None),
            (Gemini, &post, "v1beta/cachedContents", None),
            (Gemini, &post, "v1beta/tunedModels/mine:generateContent", None),
            (Gemini, &post, "v1beta/models/gemini-2.5-pro:embedContent", None),
            (Gemini, &post, "v1beta/models/gemini-2.5-pro", None),
            (Gemini, &get, "v1beta/models/gemini-2.5-pro:generateContent", None),
            (Gemini, &post, "v1alpha/models/gemini-2.5-pro:generateContent", None),
            // A route of another API is not this one's.
            (Anthropic, &post, "v1/responses", None),
            (Openai, &post, "v1/messages", None),
            (Gemini, &post, "v1/messages", None),
            // No way around the literal match: dots, empty segments, encodings, trailing slashes.
            (Openai, &post, "v1/responses/../files", None),
            (Openai, &get, "v1/models/..", None),
            (Openai, &get, "v1/models/.", None),
            (Openai, &post, "v1//responses", None),
            (Openai, &post, "v1/responses/", None),
            (Openai, &post, "/v1/responses", None),
            (Openai, &get, "v1/models/%2e%2e", None),
            (Openai, &get, "v1/models/x%2Ffiles", None),
            (Gemini, &post, "v1beta/models/..:generateContent", None),
            (Gemini, &post, "v1beta/models/a%2F..%2Ffiles:generateContent", None),
            (Gemini, &post, "v1beta/models/:generateContent", None),
            (Openai, &post, "", None),
        ];
        for (api, method, rest, expected) in cases {
            assert_eq!(route(*api, method, rest), *expected, "{api} {method} {rest}");
        }
    }

    #[test]
    fn a_refusal_names_the_route_in_one_line() {
        let refusal = allowed(ModelApi::Openai, &Method::DELETE, "v1/files/file-1").expect_err("refused");
        assert_eq!(
            refusal,
            "sortie: the model proxy does not forward DELETE /v1/files/file-1 to openai: only the inference, \
             token-count and model-list routes agents use are allowed"
        );
        let long = format!("v1/{}", "x".repeat(500));
        let refusal = allowed(ModelApi::Anthropic, &Method::GET, &long).expect_err("refused");
        assert!(refusal.len() < 400 && !refusal.contains('\n'), "{refusal}");
    }
}
