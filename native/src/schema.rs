//! A writer schema turned into the plan the reader follows: each type once, each span field with what is done to it.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyString;
use serde_json::Value;

/// One Avro type, as the reader walks it.
pub enum Schema {
    Null,
    Boolean,
    Long,
    Float,
    Double,
    String,
    Bytes,
    Fixed(usize),
    Enum(Vec<Py<PyString>>),
    Array(Box<Schema>),
    Map(Box<Schema>),
    Union(Vec<Schema>),
    Record(Vec<(Py<PyString>, Schema)>),
    Span(Box<SpanPlan>),
}

/// What the reader does with one field of a span record.
pub enum SpanField {
    /// Decoded into the node's keyword at this slot.
    Value(Slot, Schema),
    /// A token array kept encoded (0 prompt ids, 1 response ids, 2 logprobs).
    Tokens(usize, Schema),
    /// The attributes map: only the training flag is read from it.
    Flag(Schema),
    /// Stepped over; strings are checked to be UTF-8 only where `checked` (a field read and dropped).
    Skip(Schema, bool),
}

/// The node keywords a span field feeds, in the order of `SLOT_FIELDS`.
pub type Slot = usize;

pub const SLOT_FIELDS: [&str; 16] = [
    "span_id", "rollout_id", "attempt_id", "parent_id", "name", "kind", "start_time_us", "end_time_us", "status",
    "agent_name", "task_id", "group_id", "model", "policy_version", "reward", "reward_dimensions",
];
pub const TOKEN_FIELDS: [&str; 3] = ["prompt_token_ids", "response_token_ids", "response_logprobs"];
const FLAG_FIELD: &str = "attributes";
const SPAN_MARKERS: [&str; 5] = ["span_id", "attempt_id", "kind", "start_time_us", "end_time_us"];

/// A span record's fields in writer order, and the class each span becomes.
pub struct SpanPlan {
    pub fields: Vec<SpanField>,
    pub node: Py<PyAny>,
}

/// Builds plans; `skipped` fields are stepped over unread, `node` makes each span record.
pub struct Planner<'py> {
    pub py: Python<'py>,
    pub skipped: Vec<String>,
    pub node: Py<PyAny>,
}

fn unsupported(what: String) -> PyErr {
    PyValueError::new_err(what)
}

impl Planner<'_> {
    pub fn plan(&self, schema: &Value) -> PyResult<Schema> {
        match schema {
            Value::String(name) => primitive(name),
            Value::Array(branches) => Ok(Schema::Union(branches.iter().map(|b| self.plan(b)).collect::<PyResult<_>>()?)),
            Value::Object(spec) => {
                let kind = spec.get("type").ok_or_else(|| unsupported(format!("a schema without a type: {schema}")))?;
                match kind.as_str() {
                    Some("record") => self.record(spec.get("fields")),
                    Some("enum") => {
                        let symbols = spec.get("symbols").and_then(Value::as_array)
                            .ok_or_else(|| unsupported("an enum without symbols".into()))?;
                        Ok(Schema::Enum(symbols.iter().map(|s| {
                            s.as_str().map(|s| PyString::intern(self.py, s).unbind())
                                .ok_or_else(|| unsupported("an enum symbol that is not a string".into()))
                        }).collect::<PyResult<_>>()?))
                    }
                    Some("array") => Ok(Schema::Array(Box::new(self.plan(item(spec, "items")?)?))),
                    Some("map") => Ok(Schema::Map(Box::new(self.plan(item(spec, "values")?)?))),
                    Some("fixed") => Ok(Schema::Fixed(spec.get("size").and_then(Value::as_u64)
                        .ok_or_else(|| unsupported("a fixed without a size".into()))? as usize)),
                    _ => self.plan(kind), // {"type": "long", "logicalType": ...}, or a nested type
                }
            }
            _ => Err(unsupported(format!("cannot read Avro type {schema}"))),
        }
    }

    fn record(&self, fields: Option<&Value>) -> PyResult<Schema> {
        let fields = fields.and_then(Value::as_array).ok_or_else(|| unsupported("a record without fields".into()))?;
        let mut named = Vec::with_capacity(fields.len());
        for field in fields {
            let name = field.get("name").and_then(Value::as_str)
                .ok_or_else(|| unsupported("a record field without a name".into()))?;
            let kind = field.get("type").ok_or_else(|| unsupported(format!("field {name} has no type")))?;
            named.push((name, kind));
        }
        if SPAN_MARKERS.iter().all(|marker| named.iter().any(|(name, _)| name == marker)) {
            return self.span(&named);
        }
        Ok(Schema::Record(named.into_iter().map(|(name, kind)| {
            Ok((PyString::intern(self.py, name).unbind(), self.plan(kind)?))
        }).collect::<PyResult<_>>()?))
    }

    fn span(&self, fields: &[(&str, &Value)]) -> PyResult<Schema> {
        let mut plan = Vec::with_capacity(fields.len());
        for (name, kind) in fields {
            let schema = self.plan(kind)?;
            plan.push(if self.skipped.iter().any(|s| s == name) {
                SpanField::Skip(schema, false)
            } else if let Some(index) = TOKEN_FIELDS.iter().position(|f| f == name) {
                if !numbers_or_null(&schema) {
                    return Err(unsupported(format!("{name}: only arrays of numbers are kept encoded")));
                }
                SpanField::Tokens(index, schema)
            } else if *name == FLAG_FIELD {
                SpanField::Flag(schema)
            } else if let Some(slot) = SLOT_FIELDS.iter().position(|f| f == name) {
                SpanField::Value(slot, schema)
            } else {
                SpanField::Skip(schema, true)
            });
        }
        Ok(Schema::Span(Box::new(SpanPlan { fields: plan, node: self.node.clone_ref(self.py) })))
    }
}

fn item<'a>(spec: &'a serde_json::Map<String, Value>, key: &str) -> PyResult<&'a Value> {
    spec.get(key).ok_or_else(|| unsupported(format!("a schema without its {key}")))
}

fn primitive(name: &str) -> PyResult<Schema> {
    Ok(match name {
        "null" => Schema::Null,
        "boolean" => Schema::Boolean,
        "int" | "long" => Schema::Long,
        "float" => Schema::Float,
        "double" => Schema::Double,
        "string" => Schema::String,
        "bytes" => Schema::Bytes,
        _ => return Err(unsupported(format!("cannot read Avro type {name:?}"))),
    })
}

/// Token arrays are kept as bytes: an array of numbers, null, or a union of those.
fn numbers_or_null(schema: &Schema) -> bool {
    match schema {
        Schema::Null => true,
        Schema::Array(items) => matches!(**items, Schema::Long | Schema::Float | Schema::Double),
        Schema::Union(branches) => branches.iter().all(numbers_or_null),
        _ => false,
    }
}
