//! agentstream's compiled hot paths: span batches read straight from their Avro bytes into the stream worker's nodes,
//! the OTLP collector's arrays of values read in bulk (`otlp`), and the publisher's SpanBatch records finished with
//! their token ids' varints (`spans_out`).
//!
//! The Python reader (`agentstream.schemas.span_reader`) is the reference: the same writer schema,
//! the same nodes, token arrays kept encoded, the same `MalformedSpan` for bytes that do not hold
//! a datum. Every read is bounds-checked: any byte string ends as nodes or that error.

mod cursor;
mod otlp;
mod schema;
mod spans_out;

use cursor::{Cursor, Fail};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyList, PyString};
use schema::{Planner, Schema, SpanField, SpanPlan, SLOT_FIELDS};

/// Node keywords, in the order of `SLOT_FIELDS` (the Avro names the Python node does not use are renamed).
const NODE_KEYWORDS: [&str; 16] = [
    "span_id", "rollout_id", "attempt_id", "parent_id", "name", "kind", "start_us", "end_us", "status",
    "agent_name", "task_id", "group_id", "model", "policy_version", "reward", "reward_dimensions",
];
/// Slots whose missing or empty value becomes "" (rollout_id, parent_id, agent_name, task_id, group_id, model).
const EMPTY_STRING_SLOTS: [usize; 6] = [1, 3, 9, 10, 11, 12];
const STATUS_SLOT: usize = 8;
const DIMENSIONS_SLOT: usize = 15;
const END: &[u8] = b"\x00";

/// Reads the datums of one writer schema; spans become `node(**keywords)` as the Python reader's do.
#[pyclass(frozen, module = "agentstream_native")]
struct SpanReader {
    plan: Schema,
    malformed: Py<PyAny>,
    keywords: Vec<Py<PyString>>,
    train_key: Vec<u8>,
    train_words: Vec<(Vec<u8>, bool)>,
    names: Names,
}

struct Names {
    has_token_ids: Py<PyString>,
    train: Py<PyString>,
    tokens: Py<PyString>,
    unset: Py<PyString>,
    empty: Py<PyString>,
}

#[pymethods]
impl SpanReader {
    /// `schema_json`: the writer schema (self-contained JSON); `skipped`: span fields stepped over unread;
    /// `train_key` and `train_words`: the attribute that carries the training flag and the words it may hold.
    #[new]
    fn new(py: Python<'_>, schema_json: &str, node: Py<PyAny>, malformed: Py<PyAny>, skipped: Vec<String>,
           train_key: Vec<u8>, train_words: Vec<(Vec<u8>, bool)>) -> PyResult<Self> {
        let schema: serde_json::Value = serde_json::from_str(schema_json)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("the writer schema is not JSON: {e}")))?;
        let plan = Planner { py, skipped, node }.plan(&schema)?;
        Ok(SpanReader {
            plan,
            malformed,
            keywords: NODE_KEYWORDS.iter().map(|k| PyString::intern(py, k).unbind()).collect(),
            train_key,
            train_words,
            names: Names {
                has_token_ids: PyString::intern(py, "has_token_ids").unbind(),
                train: PyString::intern(py, "train").unbind(),
                tokens: PyString::intern(py, "tokens").unbind(),
                unset: PyString::intern(py, "UNSET").unbind(),
                empty: PyString::intern(py, "").unbind(),
            },
        })
    }

    /// One datum at the start of `body`: its value and the position after it. `what` names it in errors.
    fn datum(&self, py: Python<'_>, body: &[u8], what: &str) -> PyResult<(PyObject, usize)> {
        let mut cursor = Cursor::new(body);
        let value = self.read(py, &self.plan, &mut cursor).map_err(|f| self.error(py, f, what))?;
        Ok((value, cursor.position))
    }

    /// `count` datums back to back (a block of an Avro container file).
    fn rows(&self, py: Python<'_>, count: usize, datums: &[u8], what: &str) -> PyResult<Vec<PyObject>> {
        let mut cursor = Cursor::new(datums);
        let mut rows = Vec::with_capacity(count.min(datums.len()));
        for _ in 0..count {
            rows.push(self.read(py, &self.plan, &mut cursor).map_err(|f| self.error(py, f, what))?);
        }
        Ok(rows)
    }
}

impl SpanReader {
    fn error(&self, py: Python<'_>, fail: Fail, what: &str) -> PyErr {
        let message = match fail {
            Fail::Python(error) => return error,
            Fail::Short => format!("the {what} is cut short: it ends inside a value of its writer schema"),
            Fail::Utf8(detail) => format!("a string in the {what} is not UTF-8: {detail}"),
            Fail::Bad(reason) => reason,
        };
        match self.malformed.bind(py).call1((message,)) {
            Ok(error) => PyErr::from_value(error),
            Err(error) => error,
        }
    }

    fn read(&self, py: Python<'_>, schema: &Schema, cursor: &mut Cursor) -> Result<PyObject, Fail> {
        Ok(match schema {
            Schema::Null => py.None(),
            Schema::Boolean => pyo3::types::PyBool::new(py, cursor.byte()? != 0).to_owned().into_any().unbind(),
            Schema::Long => cursor.long()?.into_pyobject(py)?.into_any().unbind(),
            Schema::Float => PyFloat::new(py, cursor.float()?).into_any().unbind(),
            Schema::Double => PyFloat::new(py, cursor.double()?).into_any().unbind(),
            Schema::String => PyString::new(py, cursor.string()?).into_any().unbind(),
            Schema::Bytes => {
                let size = cursor.length()?;
                PyBytes::new(py, cursor.take(size)?).into_any().unbind()
            }
            Schema::Fixed(size) => PyBytes::new(py, cursor.take(*size)?).into_any().unbind(),
            Schema::Enum(symbols) => symbols[cursor.enum_index(symbols.len())?].clone_ref(py).into_any(),
            Schema::Union(branches) => {
                let branch = cursor.branch(branches.len())?;
                self.read(py, &branches[branch], cursor)?
            }
            Schema::Array(items) => {
                let list = PyList::empty(py);
                while let Some(count) = cursor.block(min_size(items))? {
                    for _ in 0..count {
                        list.append(self.read(py, items, cursor)?)?;
                    }
                }
                list.into_any().unbind()
            }
            Schema::Map(values) => {
                let dict = PyDict::new(py);
                while let Some(count) = cursor.block(1)? {
                    for _ in 0..count {
                        let key = PyString::new(py, cursor.string()?);
                        dict.set_item(key, self.read(py, values, cursor)?)?;
                    }
                }
                dict.into_any().unbind()
            }
            Schema::Record(fields) => {
                let dict = PyDict::new(py);
                for (name, field) in fields {
                    dict.set_item(name.bind(py), self.read(py, field, cursor)?)?;
                }
                dict.into_any().unbind()
            }
            Schema::Span(plan) => self.span(py, plan, cursor)?,
        })
    }

    fn span(&self, py: Python<'_>, plan: &SpanPlan, cursor: &mut Cursor) -> Result<PyObject, Fail> {
        let mut slots: [Option<PyObject>; SLOT_FIELDS.len()] = Default::default();
        let mut tokens: [Option<&[u8]>; 3] = [None; 3];
        let mut train: Option<bool> = None;
        for field in &plan.fields {
            match field {
                SpanField::Value(slot, schema) => slots[*slot] = Some(self.read(py, schema, cursor)?),
                SpanField::Tokens(index, schema) => tokens[*index] = cursor.raw_numbers(schema)?,
                SpanField::Flag(schema) => train = self.flag(schema, cursor)?,
                SpanField::Skip(schema, checked) => cursor.skip(schema, *checked)?,
            }
        }
        let keywords = PyDict::new(py);
        for (slot, value) in slots.iter_mut().enumerate() {
            let value = match value.take() {
                Some(value) if !value.is_none(py) && !(has_default(slot) && is_empty_string(py, &value)) => value,
                _ => self.default_value(py, slot),
            };
            keywords.set_item(self.keywords[slot].bind(py), value)?;
        }
        let prompt = tokens[0].unwrap_or(END);
        let response = tokens[1].unwrap_or(END);
        let has_tokens = prompt != END && response != END;
        let encoded = if has_tokens {
            [prompt, response, tokens[2].unwrap_or(END)].concat()
        } else {
            Vec::new()
        };
        keywords.set_item(self.names.has_token_ids.bind(py), has_tokens)?;
        keywords.set_item(self.names.tokens.bind(py), PyBytes::new(py, &encoded))?;
        keywords.set_item(self.names.train.bind(py), train)?;
        Ok(plan.node.bind(py).call((), Some(&keywords))?.unbind())
    }

    /// What a node gets for a field that is missing, null or (where it has a default) empty, as the Python reader's
    /// ``value or default`` gives it.
    fn default_value(&self, py: Python<'_>, slot: usize) -> PyObject {
        if EMPTY_STRING_SLOTS.contains(&slot) {
            self.names.empty.clone_ref(py).into_any()
        } else if slot == STATUS_SLOT {
            self.names.unset.clone_ref(py).into_any()
        } else if slot == DIMENSIONS_SLOT {
            PyDict::new(py).into_any().unbind()
        } else {
            py.None()
        }
    }

    /// Steps over the attributes, returning the training flag they hold (None: absent, or not one of its words).
    fn flag(&self, schema: &Schema, cursor: &mut Cursor) -> Result<Option<bool>, Fail> {
        match schema {
            Schema::Union(branches) => {
                let branch = cursor.branch(branches.len())?;
                self.flag(&branches[branch], cursor)
            }
            Schema::Map(values) if matches!(**values, Schema::String) => {
                let mut flag = None;
                while let Some(count) = cursor.block(1)? {
                    for _ in 0..count {
                        let size = cursor.length()?;
                        let key = cursor.take(size)?;
                        let value_size = cursor.length()?;
                        let value = cursor.take(value_size)?;
                        if key == self.train_key.as_slice() {
                            let word = python_strip(value).to_ascii_lowercase();
                            flag = self.train_words.iter().find(|(w, _)| *w == word).map(|(_, flag)| *flag);
                        }
                    }
                }
                Ok(flag)
            }
            other => {
                cursor.skip(other, !matches!(other, Schema::String | Schema::Bytes))?;
                Ok(None)
            }
        }
    }
}

fn has_default(slot: usize) -> bool {
    EMPTY_STRING_SLOTS.contains(&slot) || slot == STATUS_SLOT || slot == DIMENSIONS_SLOT
}

fn is_empty_string(py: Python<'_>, value: &PyObject) -> bool {
    value.bind(py).downcast::<PyString>().map(|s| s.to_str().map(str::is_empty).unwrap_or(false)).unwrap_or(false)
}

/// The least bytes one encoded item takes (a bound on a block's count; null items take none).
fn min_size(schema: &Schema) -> usize {
    match schema {
        Schema::Null => 0,
        Schema::Fixed(size) => *size,
        Schema::Record(fields) => fields.iter().map(|(_, f)| min_size(f)).sum(),
        _ => 1,
    }
}

/// bytes.strip(): the ASCII whitespace Python strips, vertical tab included.
fn python_strip(value: &[u8]) -> &[u8] {
    let blank = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c');
    let start = value.iter().position(|b| !blank(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !blank(b)).map_or(start, |i| i + 1);
    &value[start..end]
}

#[pymodule]
fn agentstream_native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<SpanReader>()?;
    module.add_function(wrap_pyfunction!(otlp::array_values, module)?)?;
    module.add_function(wrap_pyfunction!(spans_out::span_records, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
