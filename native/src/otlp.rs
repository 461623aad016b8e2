//! OTLP's arrays of values read in bulk: an `ArrayValue` message's bytes to a Python list, in one pass.
//!
//! The collector hands over the bytes protobuf's own runtime serialized (canonical: each value's one field,
//! in order); anything else, a nested array or map, bytes, values of mixed kinds, an unset value, answers None
//! and the collector reads that array value by value, as before.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyList, PyString};

const VALUES: u64 = 1; // ArrayValue.values, repeated AnyValue
const STRING: u64 = 1;
const BOOL: u64 = 2;
const INT: u64 = 3;
const DOUBLE: u64 = 4;
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LENGTH: u64 = 2;

struct Wire<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Wire<'a> {
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self.bytes.get(self.at)?;
            self.at += 1;
            value |= u64::from(byte & 0x7F) << shift;
            if byte < 0x80 {
                return Some(value);
            }
        }
        None
    }

    fn take(&mut self, size: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(size).filter(|end| *end <= self.bytes.len())?;
        let chunk = &self.bytes[self.at..end];
        self.at = end;
        Some(chunk)
    }

    fn done(&self) -> bool {
        self.at == self.bytes.len()
    }
}

/// One AnyValue of a primitive kind: its field number and the Python value.
fn any_value<'py>(py: Python<'py>, bytes: &[u8]) -> Option<(u64, Bound<'py, PyAny>)> {
    let mut wire = Wire { bytes, at: 0 };
    let key = wire.varint()?;
    let value = match (key >> 3, key & 7) {
        (STRING, LENGTH) => {
            let size = usize::try_from(wire.varint()?).ok()?;
            PyString::new(py, std::str::from_utf8(wire.take(size)?).ok()?).into_any()
        }
        (BOOL, VARINT) => PyBool::new(py, wire.varint()? != 0).to_owned().into_any(),
        (INT, VARINT) => (wire.varint()? as i64).into_pyobject(py).ok()?.into_any(),
        (DOUBLE, FIXED64) => PyFloat::new(py, f64::from_le_bytes(wire.take(8)?.try_into().ok()?)).into_any(),
        _ => return None,
    };
    wire.done().then_some((key >> 3, value))
}

/// The values of a serialized `ArrayValue` as a list, when every one is a string, a bool, an int or a double, all
/// of one kind; None otherwise (the caller reads it value by value).
#[pyfunction]
pub fn array_values<'py>(py: Python<'py>, serialized: &[u8]) -> PyResult<Option<Bound<'py, PyList>>> {
    let list = PyList::empty(py);
    let mut wire = Wire { bytes: serialized, at: 0 };
    let mut kind = None;
    while !wire.done() {
        let Some(key) = wire.varint() else { return Ok(None) };
        if key != (VALUES << 3 | LENGTH) {
            return Ok(None);
        }
        let Some(item) = wire.varint().and_then(|size| usize::try_from(size).ok()).and_then(|size| wire.take(size))
        else {
            return Ok(None);
        };
        let Some((field, value)) = any_value(py, item) else { return Ok(None) };
        if *kind.get_or_insert(field) != field {
            return Ok(None);
        }
        list.append(value)?;
    }
    Ok(Some(list))
}
